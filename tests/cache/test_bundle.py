"""Bundles: export, import elsewhere, and refuse anything tampered, unsigned when a key is set, or foreign."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch

from tests.cached_runs import compile_and_run
from tpucompile import artifacts, cli
from tpucompile.cache import Entry, PersistentCache
from tpucompile.cache.bundle import BundleError, export_bundle, import_bundle, sign
from tpucompile.runtime import get_target

SECRET = b"correct horse battery staple"


def f(x):
    return torch.relu(x) @ x.T + 2


@pytest.fixture
def warmed(tmp_path, monkeypatch):
    """A cache directory holding the plan, program and executable entries of ``f``."""
    source = tmp_path / "source"
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(source))
    x = torch.randn(4, 4)
    compile_and_run(f, x)
    return source, x


def _environment():
    return artifacts.environment(get_target())


def test_round_trip_through_the_cli(tmp_path, monkeypatch, warmed, capsys):
    source, x = warmed
    bundle = tmp_path / "cache.bundle"
    monkeypatch.setenv("TPUCOMPILE_CACHE_SIGNING_KEY", SECRET.decode())
    assert cli.main(["cache", "export", str(bundle), "--dir", str(source), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported == {"bundle": str(bundle), "entries": 3, "signed": True}
    target = tmp_path / "target"
    assert cli.main(["cache", "import", str(bundle), "--dir", str(target), "--json"]) == 0
    imported = json.loads(capsys.readouterr().out)
    assert len(imported["imported"]) == 3 and imported["verified_signature"] and not imported["skipped"]
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(target))
    result, (event,) = compile_and_run(f, x, cache_mode="strict")
    torch.testing.assert_close(result, f(x))
    assert event.tier == "local" and event.program_tier == "local"


def _tamper_entry_bytes(bundle) -> None:
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.startswith("entries/"))
    data = bytearray(bundle.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0x10
    bundle.write_bytes(bytes(data))


def test_tampered_entry_is_refused(tmp_path, warmed):
    source, _ = warmed
    bundle = tmp_path / "b.bundle"
    export_bundle(PersistentCache(source), bundle, _environment())
    _tamper_entry_bytes(bundle)
    target = PersistentCache(tmp_path / "target")
    with pytest.raises(BundleError, match="tampered"):
        import_bundle(target, bundle, _environment())
    assert not list(target.local.list_keys()), "nothing is imported from a refused bundle"


def test_signed_bundle_with_altered_manifest_is_refused(tmp_path, warmed):
    source, _ = warmed
    bundle = tmp_path / "b.bundle"
    export_bundle(PersistentCache(source), bundle, _environment(), key=SECRET)
    members = {}
    with tarfile.open(bundle) as tar:
        for member in tar.getmembers():
            members[member.name] = tar.extractfile(member).read()
    manifest = json.loads(members["manifest.json"])
    manifest["created"] += 1
    members["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(bundle, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="signature does not match"):
        import_bundle(PersistentCache(tmp_path / "t"), bundle, _environment(), key=SECRET)
    with pytest.raises(BundleError, match="signature does not match"):
        import_bundle(PersistentCache(tmp_path / "t"), bundle, _environment(), key=b"another key")


def test_unsigned_bundle_is_refused_when_a_key_is_set(tmp_path, warmed):
    source, _ = warmed
    bundle = tmp_path / "b.bundle"
    export_bundle(PersistentCache(source), bundle, _environment())
    with pytest.raises(BundleError, match="not signed"):
        import_bundle(PersistentCache(tmp_path / "t"), bundle, _environment(), key=SECRET)
    report = import_bundle(PersistentCache(tmp_path / "t"), bundle, _environment())
    assert len(report.imported) == 3 and not report.signed


def test_entries_for_another_environment_are_skipped_with_the_reason(tmp_path):
    environment = _environment()
    source = PersistentCache(tmp_path / "source")
    foreign = Entry.create({"kind": "executable", "program": "7" * 64, **environment, "jaxlib": "0.9.0",
                            "device_kind": "TPU v5 lite"}, b"x" * 100, {}, 1.0)
    native = Entry.create({"kind": "executable", "program": "8" * 64, **environment}, b"y" * 100, {}, 1.0)
    source.put(foreign)
    source.put(native)
    bundle = tmp_path / "b.bundle"
    export_bundle(source, bundle, environment, key=SECRET)
    report = import_bundle(PersistentCache(tmp_path / "t"), bundle, environment, key=SECRET)
    assert report.imported == [native.key]
    reason = report.skipped[foreign.key]
    assert "jaxlib: built with \"0.9.0\", this environment has \"" in reason
    assert "device_kind: built with \"TPU v5 lite\"" in reason


def test_signature_is_an_hmac_of_the_manifest():
    assert sign(b"m", b"k") != sign(b"m", b"k2") and len(sign(b"m", b"k")) == 64
