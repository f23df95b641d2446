"""The test suite as a package, so that test files import the shared support modules by their full name
(``from tests.support import ...``) without any ``sys.path`` edits: pytest's default import mode puts the
repository root, the first folder above without an ``__init__.py``, on ``sys.path``."""
