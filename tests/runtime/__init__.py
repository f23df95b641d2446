"""Part of the ``tests`` package (see ``tests/__init__.py``)."""
