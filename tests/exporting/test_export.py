"""``tpucompile.export``: the examples' LLaMA and ResNet exported and served by a process that never imports
torch (numpy in, jax only), matching eager PyTorch; one artifact serving a dynamic batch at several sizes;
``tpucompile.load``; ``tpucompile export``; the manifest; and the refusals, which name the op and the line."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpucompile
from tpucompile.cli import main as cli_main
from tpucompile.errors import UnsupportedOpError
from tpucompile.serving import ServingError, load_served

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def _example(name: str):
    """An example script as a module (its ``main`` does not run); ``llama`` imports ``measure`` beside it."""
    sys.path.insert(0, EXAMPLES)
    try:
        spec = importlib.util.spec_from_file_location(f"export_test_{name}", os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(EXAMPLES)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small LLaMA (dynamic batch, buckets 4 and 8) and a small ResNet (static) exported, with eager
    PyTorch's outputs on the inputs the tests serve."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    llama_module, resnet_module = _example("llama"), _example("resnet")
    llama = llama_module.Llama(llama_module.LlamaConfig(n_layers=1)).eval()
    resnet = resnet_module.ResNet(resnet_module.ResNetConfig(stem_width=8, widths=(8, 16), image_size=16)).eval()
    with torch.no_grad():  # running statistics that are not the initial ones, so BatchNorm does something
        for module in resnet.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    batch = torch.export.Dim("batch", min=1, max=8)
    manifest = tpucompile.export(llama, (torch.randint(0, 256, (2, 8)),), root / "llama",
                                 dynamic_shapes=({0: batch},), buckets=[4, 8])
    image = torch.randn(2, 3, 16, 16)
    tpucompile.export(resnet, (image,), root / "resnet")
    tokens = {n: torch.randint(0, 256, (n, 8)) for n in (1, 3, 8)}
    with torch.no_grad():
        expected = {f"llama_{n}": llama(t).numpy() for n, t in tokens.items()}
        expected["resnet"] = resnet(image).numpy()
    np.savez(root / "cases.npz", image=image.numpy(), **{f"tokens_{n}": t.numpy() for n, t in tokens.items()},
             **expected)
    return {"root": root, "manifest": manifest, "llama": llama, "tokens": tokens}


_SERVE_WITHOUT_TORCH = """
import json, sys
import jax
import numpy as np
from tpucompile.serving import load_served

root = sys.argv[1]
cases = np.load(f"{root}/cases.npz")
errors = {}
with open(f"{root}/resnet/program.jaxexport", "rb") as stream:  # the program alone, as jax serves it
    program = jax.export.deserialize(bytearray(stream.read()))
resnet = load_served(f"{root}/resnet")  # for its weights, in the manifest's order
args = [resnet.weights[e["weight"]] if e["kind"] == "weight" else cases["image"] for e in resnet.manifest["inputs"]]
(logits,) = program.call(*args)
errors["resnet"] = float(np.abs(np.asarray(logits) - cases["resnet"]).max())
llama = load_served(f"{root}/llama")
for n in (1, 3, 8):
    (logits,) = llama(cases[f"tokens_{n}"])
    assert logits.shape == cases[f"llama_{n}"].shape, (logits.shape, n)
    errors[f"llama_{n}"] = float(np.abs(logits - cases[f"llama_{n}"]).max())
assert "torch" not in sys.modules, "serving imported torch"
print(json.dumps(errors))
"""


def test_examples_served_by_a_process_without_torch(exported):
    """The LLaMA at batch 1, 3 and 8 (two bucket programs of one artifact) and the ResNet run by numpy and
    jax alone, matching eager PyTorch; the process never imports torch."""
    done = subprocess.run([sys.executable, "-c", _SERVE_WITHOUT_TORCH, str(exported["root"])], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(errors) == {"resnet", "llama_1", "llama_3", "llama_8"}
    for case, error in errors.items():
        assert error < 2e-5, (case, error)


def test_serving_module_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, tpucompile.serving, tpucompile; "
                           "assert 'torch' not in sys.modules and 'jax' not in sys.modules"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_manifest_describes_inputs_weights_outputs_and_buckets(exported):
    from safetensors.numpy import load_file

    manifest = exported["manifest"]
    root = exported["root"] / "llama"
    assert json.loads((root / "manifest.json").read_text()) == manifest
    assert manifest["format"] == "tpucompile-export" and manifest["format_version"] == 1
    assert manifest["versions"] == {"torch": torch.__version__, "jax": __import__("jax").__version__,
                                    "tpucompile": tpucompile.__version__}
    kinds = [entry["kind"] for entry in manifest["inputs"]]
    assert kinds == ["weight"] * kinds.count("weight") + ["user_input", "size"]
    user = manifest["inputs"][kinds.index("user_input")]
    assert (user["name"], user["shape"], user["dtype"]) == ("tokens", ["batch", 8], "int64")
    assert manifest["inputs"][-1] == {"name": "batch", "kind": "size", "symbol": "batch", "shape": [],
                                      "dtype": "int32"}
    assert manifest["symbols"]["batch"]["min"] == 1 and manifest["symbols"]["batch"]["max"] == 8
    assert manifest["symbols"]["batch"]["dims"] == ["tokens:0"]
    assert [p["sizes"] for p in manifest["programs"]] == [{"batch": 4}, {"batch": 8}]
    assert all((root / p["file"]).is_file() for p in manifest["programs"])
    assert [(o["shape"], o["dtype"]) for o in manifest["outputs"]] == [(["batch", 8, 256], "float32")]
    stored = load_file(root / manifest["weights_file"])
    state = {**dict(exported["llama"].named_parameters()), **dict(exported["llama"].named_buffers())}
    weights = [entry for entry in manifest["inputs"] if entry["kind"] == "weight"]
    assert sorted(stored) == sorted(entry["weight"] for entry in weights)
    for entry in weights:
        assert list(stored[entry["weight"]].shape) == entry["shape"]
        np.testing.assert_array_equal(stored[entry["weight"]], state[entry["weight"]].detach().numpy())


def test_load_round_trip_and_sizes_past_the_buckets(exported):
    loaded = tpucompile.load(exported["root"] / "llama")
    tokens = exported["tokens"][3]
    logits = loaded(tokens)
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, 8, 256)
    with torch.no_grad():
        torch.testing.assert_close(logits, exported["llama"](tokens), atol=2e-5, rtol=1e-5)
    with pytest.raises(ServingError, match="batch"):
        loaded(torch.randint(0, 256, (9, 8)))
    with pytest.raises(ServingError, match="int64"):
        loaded(tokens.int())


class _Summary(torch.nn.Module):
    """Per-row probabilities and a mean over the batch: the mean sees the padding unless the program knows
    the actual batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.hidden(x))
        return {"probs": self.head(h).softmax(-1), "mean": h.mean(0)}


def test_dynamic_batch_served_at_three_sizes_by_one_program(tmp_path):
    torch.manual_seed(1)
    model = _Summary().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    manifest = tpucompile.export(model, (torch.randn(5, 6),), tmp_path, dynamic_shapes=({0: batch},))
    assert [p["sizes"] for p in manifest["programs"]] == [{"batch": 16}]
    loaded = tpucompile.load(tmp_path)
    for size in (1, 7, 16):
        x = torch.randn(size, 6)
        got = loaded(x)
        assert set(got) == {"probs", "mean"} and got["probs"].shape == (size, 3)
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(got["probs"], want["probs"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["mean"], want["mean"], atol=1e-6, rtol=1e-5)


def test_interpolation_exports(tmp_path):
    """``F.interpolate`` exports although the backend's rewrite of it does not apply to torch.export's graph."""

    class Upsampled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([F.interpolate(x, scale_factor=2, mode=m) for m in ("nearest", "bilinear")], 1)

    x = torch.randn(1, 2, 5, 4)
    tpucompile.export(Upsampled(), (x,), tmp_path)
    torch.testing.assert_close(tpucompile.load(tmp_path)(x), Upsampled()(x), atol=1e-6, rtol=1e-6)


def test_linear_algebra_with_error_checks(tmp_path):
    """``linalg.solve`` carries an effect token for its error check in torch.export's graph; the check is
    dropped (a program cannot raise) and the solve exported. Ops lowered through jax for one platform keep the
    program to that platform."""

    class Solve(torch.nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return torch.linalg.solve(a, a.sum(-1, keepdim=True))

    a = torch.randn(3, 3) + 3 * torch.eye(3)
    tpucompile.export(Solve(), (a,), tmp_path)
    torch.testing.assert_close(tpucompile.load(tmp_path)(a), Solve()(a), atol=1e-5, rtol=1e-5)
    with pytest.raises(UnsupportedOpError, match="export once per platform"):
        tpucompile.export(Solve(), (a,), tmp_path / "both", platforms=("cpu", "cuda"))


def test_dtype_casts_complex_weights_and_transforms_export(tmp_path):
    """``.to()`` puts a metadata assertion in torch.export's graph (decided while lowering); a complex64
    weight crosses in safetensors' ``C64``; FFTs and complex results export and load back."""

    class Spectral(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.filter = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            spectrum = torch.fft.fft(x.to(torch.complex64) @ self.filter)
            return spectrum, torch.fft.irfft(spectrum[..., :9], n=16).to(torch.float64)

    torch.manual_seed(3)
    model, x = Spectral(), torch.randn(4, 16)
    tpucompile.export(model, (x,), tmp_path)
    torch.testing.assert_close(tpucompile.load(tmp_path)(x), model(x), atol=1e-4, rtol=1e-4)


def test_bfloat16_weights_and_results(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU()).to(torch.bfloat16).eval()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    tpucompile.export(model, (x,), tmp_path)
    got = tpucompile.load(tmp_path)(x)
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=2e-2, rtol=2e-2)


@torch.library.custom_op("export_test::soft_clip", mutates_args=())
def _soft_clip(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy().clip(-1, 1))  # numpy: it cannot be traced into the program


@_soft_clip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _CustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _soft_clip(x * 2) + 1  # an op of the user's own, which has no lowering


class _Convolved(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()  # not exact when its batch is padded


def _line_of(cls: type, text: str) -> str:
    lines, start = inspect.getsourcelines(cls.forward)
    return f"{__file__}:{start + next(k for k, line in enumerate(lines) if text in line)}"


def test_unexportable_ops_are_refused_naming_the_op_and_line(tmp_path):
    with pytest.raises(UnsupportedOpError) as refused:
        tpucompile.export(_CustomOp(), (torch.randn(2, 4),), tmp_path / "up")
    assert "no lowering for export_test.soft_clip" in str(refused.value), refused.value
    assert "eager PyTorch" in str(refused.value) and _line_of(_CustomOp, "_soft_clip(") in str(refused.value)
    with pytest.raises(UnsupportedOpError) as refused:
        tpucompile.export(_Convolved(), (torch.randn(2, 2, 6, 6),), tmp_path / "conv",
                          dynamic_shapes=({0: torch.export.Dim("batch", max=8)},))
    assert "aten.convolution" in str(refused.value) and _line_of(_Convolved, "self.conv") in str(refused.value)
    assert not (tmp_path / "up").exists() and not (tmp_path / "conv").exists()


def test_command_line_exports_what_the_script_describes(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent("""
        import torch

        def export_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).eval(), (torch.randn(2, 4),)

        if __name__ == "__main__":
            raise SystemExit("the export command must not run the script's main block")
    """))
    assert cli_main(["export", str(script), "--out", str(tmp_path / "out")]) == 0
    assert "exported to" in capsys.readouterr().out
    served = load_served(tmp_path / "out")
    x = np.random.default_rng(0).standard_normal((2, 4), dtype=np.float32)
    namespace = {}
    exec(script.read_text(), namespace)
    model, _ = namespace["export_model"]()
    with torch.no_grad():
        np.testing.assert_allclose(served(x)[0], model(torch.from_numpy(x)).numpy(), atol=1e-6)
    assert cli_main(["export", str(script), "--out", str(tmp_path / "x"), "--function", "missing"]) == 10
    refused = tmp_path / "refused.py"
    refused.write_text("import torch\n\nclass M(torch.nn.Module):\n"
                       "    def forward(self, x):\n        return torch.ops.export_test.soft_clip(x)\n\n"
                       "def export_model():\n    return M(), (torch.randn(1, 1, 2, 2),)\n")
    assert cli_main(["export", str(refused), "--out", str(tmp_path / "r")]) == 11
    assert f"{refused}:5" in capsys.readouterr().err
