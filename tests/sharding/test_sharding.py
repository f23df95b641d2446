"""Sharding: meshes, plans and their errors (in this process), and SPMD runs over 8 virtual CPU devices and
over 2 processes x 4 devices (in fresh processes, since jax's device count is fixed when it starts).

A sharded run must give the numbers of the run on one device: the GPT example's logits, its losses over three
AdamW steps and its parameters after them, under data, tensor and data x tensor parallelism.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import tpucompile
from tests import python_processes
from tests.support import compile_fn
from tpucompile import (
    Mesh,
    Options,
    ShardingError,
    ShardPlan,
    data_parallel,
    driver,
    fully_sharded,
    tensor_parallel,
)
from tpucompile.sharding.names import graph_inputs, input_name
from tpucompile.sharding.plan import GraphValue, decode_sharding, encode_sharding, normalize_dims, shard_option

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "sharding_worker.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


# -- meshes, plans and options ----------------------------------------------------------------------------


def test_mesh_is_a_hashable_value():
    mesh = Mesh({"data": 2, "model": 4})
    assert mesh == Mesh([("data", 2), ("model", 4)]) == Mesh.parse("data=2, model=4")
    assert hash(mesh) == hash(Mesh.parse("data=2,model=4"))
    assert mesh != Mesh({"model": 4, "data": 2})
    assert (mesh.size, mesh.axis_names, mesh.shape) == (8, ("data", "model"), (2, 4))
    assert repr(mesh) == "Mesh({'data': 2, 'model': 4})"
    for bad in ({}, {"data": 0}, {"data": 2.0}, {"1x": 2}):
        with pytest.raises(ShardingError):
            Mesh(bad)
    with pytest.raises(ShardingError, match="distinct device ids"):
        Mesh({"data": 2}, devices=[0, 0])
    with pytest.raises(ShardingError, match="data=2,model=4"):
        Mesh.parse("data:2")


def test_options_take_a_mesh_and_a_plan():
    options = Options.from_sources({"mesh": "data=2,model=4", "shard": {"idx": ("data", None)}}, environ={})
    assert options.mesh == Mesh({"data": 2, "model": 4})
    assert options.shard == ShardPlan.from_mapping({"idx": ["data", None]})
    assert hash(options) == hash(Options.from_sources({"mesh": {"data": 2, "model": 4},
                                                      "shard": {"idx": ["data", None]}}, environ={}))
    environ = {"TPUCOMPILE_MESH": "data=8", "TPUCOMPILE_SHARD": '{"*.weight": [null, "data"]}',
               "TPUCOMPILE_NUM_PROCESSES": "2", "TPUCOMPILE_PROCESS_ID": "1"}
    options = Options.from_sources(None, environ=environ)
    assert options.mesh == Mesh({"data": 8})
    assert options.shard.rules[0].dims == ((), ("data",))
    assert (options.num_processes, options.process_id) == (2, 1)
    with pytest.raises(tpucompile.OptionsError, match="mesh"):
        Options.from_sources({"mesh": 8}, environ={})
    with pytest.raises(tpucompile.OptionsError, match="shard"):
        Options.from_sources({"shard": ["idx"]}, environ={})
    with pytest.raises(tpucompile.OptionsError, match="at least 1"):
        Options.from_sources({"num_processes": 0}, environ={})


def test_dims_are_normalised_and_encoded():
    assert normalize_dims(("data", None, ("x", "y"))) == (("data",), (), ("x", "y"))
    assert normalize_dims("data") == (("data",),)
    with pytest.raises(ShardingError):
        normalize_dims((1,))
    axes = (("data", 2), ("model", 4))
    dims = (("data",), (), ("data", "model"))
    assert encode_sharding(axes, dims) == "mesh[data=2,model=4] dims[{data},{},{data,model}]"
    assert decode_sharding(encode_sharding(axes, dims)) == (axes, dims)


GPT_INPUTS = [
    GraphValue("idx", (8, 16), dtype="int64"),
    GraphValue("wte.weight", (128, 64), True, "float32"),
    GraphValue("blocks.0.attn.qkv.weight", (192, 64), True, "float32"),
    GraphValue("blocks.0.attn.qkv.bias", (192,), True, "float32"),
    GraphValue("blocks.0.attn.proj.weight", (64, 64), True, "float32"),
    GraphValue("blocks.0.attn.proj.bias", (64,), True, "float32"),
    GraphValue("positions", (16,), dtype="int64"),
    GraphValue("mask", (6, 16), dtype="bool"),
    GraphValue("step", (), dtype="int64"),
    GraphValue("lr", None),
]


def test_ready_made_plans():
    mesh = Mesh({"data": 2, "model": 4})
    plan = data_parallel(mesh) + tensor_parallel(mesh, column=["blocks.*.attn.qkv"], row=["blocks.*.attn.proj"])
    assert plan.mesh == mesh
    dims = dict(zip([i.name for i in GPT_INPUTS], plan.resolve(GPT_INPUTS, mesh), strict=True))
    assert dims == {
        "idx": (("data",), ()),
        "wte.weight": ((), ()),
        "blocks.0.attn.qkv.weight": (("model",), ()),
        "blocks.0.attn.qkv.bias": (("model",),),
        "blocks.0.attn.proj.weight": ((), ("model",)),
        "blocks.0.attn.proj.bias": ((),),
        "positions": (("data",),),  # 16 splits 2 ways: any input's first dimension is data-parallel
        "mask": (("data",), ()),
        "step": (),  # a scalar stays whole
        "lr": None,
    }
    assert data_parallel(Mesh({"batch": 8})).rules[0].dims == (("batch",),)
    with pytest.raises(ShardingError, match="data_axis"):
        data_parallel(Mesh({"x": 2, "y": 2}))
    # the first matching rule wins
    plan = ShardPlan.from_mapping({"*.qkv.weight": (None, "model"), "blocks.*": ("model",)})
    dims = plan.resolve(GPT_INPUTS[2:4], mesh)
    assert dims == (((), ("model",)), (("model",),))


def test_fully_sharded_plan_splits_every_tensor_along_the_first_dimension_it_divides():
    mesh = Mesh({"data": 2, "model": 4})
    dims = dict(zip([i.name for i in GPT_INPUTS], fully_sharded(mesh).resolve(GPT_INPUTS, mesh), strict=True))
    assert dims == {
        "idx": (("data",), ()),  # the batch
        "wte.weight": (("data",), ()),
        "blocks.0.attn.qkv.weight": (("data",), ()),
        "blocks.0.attn.qkv.bias": (("data",),),
        "blocks.0.attn.proj.weight": (("data",), ()),
        "blocks.0.attn.proj.bias": (("data",),),
        "positions": (("data",),),
        "mask": (("data",), ()),
        "step": (),  # nothing to split
        "lr": None,
    }
    odd = [GraphValue("w", (3, 6), True, "float32"), GraphValue("b", (3,), True, "float32")]
    assert fully_sharded(mesh).resolve(odd, mesh) == (((), ("data",)), ((),))  # the first dimension 2 divides
    assert fully_sharded(mesh).spread_axis(mesh) == "data" and data_parallel(mesh).spread_axis(mesh) is None


def test_fully_sharded_composes_with_tensor_parallel_in_either_order():
    mesh = Mesh({"data": 2, "model": 4})
    tp = tensor_parallel(mesh, column=["blocks.*.attn.qkv"], row=["blocks.*.attn.proj"])
    first, second = (fully_sharded(mesh) + tp).resolve(GPT_INPUTS, mesh), (tp + fully_sharded(mesh)).resolve(
        GPT_INPUTS, mesh)
    assert first == second
    dims = dict(zip([i.name for i in GPT_INPUTS], first, strict=True))
    assert dims["blocks.0.attn.qkv.weight"] == (("model", "data"), ())  # 192 splits 4 x 2 ways
    assert dims["blocks.0.attn.qkv.bias"] == (("model", "data"),)
    assert dims["blocks.0.attn.proj.weight"] == (("data",), ("model",))
    assert dims["wte.weight"] == (("data",), ())


def test_fully_sharded_option_and_axis():
    assert shard_option("fsdp").resolve(GPT_INPUTS[1:2], Mesh({"fsdp": 2, "model": 4})) == ((("fsdp",), ()),)
    assert shard_option("fsdp:x").resolve(GPT_INPUTS[1:2], Mesh({"x": 8})) == ((("x",), ()),)
    assert fully_sharded(Mesh({"replica": 8})).resolve(GPT_INPUTS[1:2], Mesh({"replica": 8})) == ((("replica",), ()),)
    with pytest.raises(ShardingError, match="no axis named 'data' or 'fsdp'"):
        shard_option("fsdp").resolve(GPT_INPUTS[1:2], Mesh({"x": 2, "y": 4}))
    with pytest.raises(ShardingError, match="'z' is not an axis"):
        fully_sharded(Mesh({"x": 2}), axis="z")
    with pytest.raises(ShardingError, match="'fsdp' or 'fsdp:AXIS'"):
        shard_option("fsdp:")
    assert "spread over data" in repr(fully_sharded(Mesh({"data": 2})))


def test_outputs_are_named_by_position():
    mesh = Mesh({"data": 2, "model": 4})
    values = [*GPT_INPUTS, GraphValue("output:0", (8, 16, 128), dtype="float32", is_output=True),
              GraphValue("output:1", (), dtype="float32", is_output=True)]
    plan = data_parallel(mesh) + ShardPlan.from_mapping({"output:0": ("data", None, "model")})
    dims = plan.resolve(values, mesh)
    assert dims[-2:] == ((("data",), (), ("model",)), None)  # outputs no entry names come back whole
    assert dims[0] == (("data",), ())  # "*" of data_parallel matches inputs, never outputs
    with pytest.raises(ShardingError, match="'output:2' matches no output"):
        ShardPlan.from_mapping({"output:2": ("data",)}).resolve(values, mesh)
    with pytest.raises(ShardingError, match=r"output 'output:1' \(float32\[\]\)"):
        ShardPlan.from_mapping({"output:*": ("data",)}).resolve(values, mesh)


@pytest.mark.parametrize("mapping,message", [
    ({"blocks.*.attn.qkv.weight": ("tensor", None)},
     r"parameter 'blocks.0.attn.qkv.weight' \(float32\[192, 64\]\) dimension 0 is split over mesh axis 'tensor', "
     r"which Mesh\(\{'data': 2, 'model': 4\}\) lacks"),
    ({"wte.weight": ("model", "data")}, None),  # fits: both axes, one per dimension
    ({"blocks.0.attn.proj.bias": (("data", "model"),)}, None),
    ({"mask": (("data", "model"),)},
     r"input 'mask' \(bool\[6, 16\]\) dimension 0 has size 6, which is not divisible by 8 \(mesh axes data=2 x "
     r"model=4 of Mesh\(\{'data': 2, 'model': 4\}\)\)"),
    ({"blocks.0.attn.qkv.bias": ("model", None)}, r"names 2 dimensions but parameter 'blocks.0.attn.qkv.bias'"),
    ({"idx": ("data", "data")}, r"uses mesh axis 'data' for more than one dimension"),
    ({"blocks.*.attn.qvk.weight": ("model", None)},
     r"'blocks.\*.attn.qvk.weight' matches no parameter or input of the compiled graph \(mesh "
     r"Mesh\(\{'data': 2, 'model': 4\}\)\); closest names: blocks.0.attn.qkv.weight"),
])
def test_plan_mistakes_are_named(mapping, message):
    mesh = Mesh({"data": 2, "model": 4})
    plan = ShardPlan.from_mapping(mapping)
    if message is None:
        plan.resolve(GPT_INPUTS, mesh)
        return
    with pytest.raises(ShardingError, match=message):
        plan.resolve(GPT_INPUTS, mesh)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)])
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x))) * self.scale


def test_graph_inputs_are_named_by_module_path():
    seen = []

    def capture(gm, example_inputs):
        seen.extend(graph_inputs(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Net(), backend=capture)(torch.randn(4, 16))
    names = {i.name: i.is_state for i in seen}
    assert names == {"x": False, "layers.0.weight": True, "layers.0.bias": True, "layers.1.weight": True,
                     "layers.1.bias": True, "scale": True}
    assert input_name("L['fn']._modules['0']._parameters['weight']") == "0.weight"
    assert input_name("L['batch']['x']") == "batch.x"
    assert input_name("weird(source)") == "weird(source)"
    # a forward wrapped by a decorator taking *args, **kwargs (Hugging Face's): named as the forward's own
    assert input_name("L['args'][0]._modules['model']._modules['layers']._modules['0']._parameters['weight']") == (
        "model.layers.0.weight")
    assert input_name("L['kwargs']['input_ids']") == "input_ids"
    assert input_name("L['args'][1]") == "args.1"


def test_a_hugging_face_models_inputs_are_named_by_module_path_through_its_forward_wrapper():
    """Hugging Face wraps its models' forwards in decorators taking ``*args, **kwargs``, so Dynamo traces the
    wrapper's frame: the parameters are still named by their path in the model and the inputs by keyword."""
    import transformers

    seen = []

    def capture(gm, example_inputs):
        seen.extend(graph_inputs(gm, example_inputs))
        return gm.forward

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64)
    torch._dynamo.reset()
    torch.compile(transformers.LlamaForCausalLM(config), backend=capture)(input_ids=torch.randint(0, 64, (2, 5)))
    names = {i.name for i in seen}
    assert {"input_ids", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "lm_head.weight"} <= names, names


def test_an_optimiser_step_names_parameters_gradients_and_state_after_the_module():
    """A compiled optimiser step holds the parameters and its state as graph attributes, which AOTAutograd lifts
    to the first inputs of its graph: they are named (and ordered) so that a plan written for the module lays
    out the step's tensors like the module's."""
    seen = []

    def capture(gm, example_inputs):
        seen.append(graph_inputs(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    net = _Net()
    torch.compile(net, backend=capture)(torch.randn(4, 16)).sum().backward()
    optimizer = torch.optim.AdamW(net.parameters())
    torch.compile(optimizer.step, backend=capture)()
    step = seen[-1]
    parameters = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    assert [v.name for v in step[:4]] == parameters  # lifted first, as AOTAutograd passes them
    assert [v.name for v in step[-4:]] == parameters  # the gradients, the step's own inputs
    assert all(v.is_state for v in step)  # so that a plan's rules for parameters (tensor_parallel's) apply
    mesh = Mesh({"model": 2})
    plan = tensor_parallel(mesh, column=["layers.0"], row=["layers.1"])
    dims = plan.resolve(step, mesh)
    assert dims[0] == dims[-4] == (("model",), ()) and dims[2] == dims[-2] == ((), ("model",))
    state = [v for v in step[4:-4] if v.shape]
    assert sorted(v.name for v in state) == sorted(parameters * 2)  # exp_avg and exp_avg_sq of each
    assert all(v.shape == dict((p.name, p.shape) for p in step[:4])[v.name] for v in state)


def _compile_fails(options: dict, match: str) -> None:
    before = driver.graphs_compiled()
    with pytest.raises(Exception, match=match) as caught:
        compile_fn(_Net(), **options)(torch.randn(4, 16))
    assert isinstance(caught.value.__cause__ or caught.value, (ShardingError, tpucompile.OptionsError)) or \
        "ShardingError" in str(caught.value)
    assert driver.graphs_compiled() == before, "the plan must be refused before anything is compiled"


def test_mistakes_fail_before_any_compile():
    import jax

    too_big = Mesh({"data": 2 * jax.device_count()})
    _compile_fails({"mesh": too_big, "shard": data_parallel(too_big)},
                   rf"needs {too_big.size} devices but the cpu platform has {jax.device_count()}.*device_count=")
    one = Mesh({"data": 1})
    _compile_fails({"mesh": one, "shard": {"layers.*.wieght": ("data",)}}, "matches no parameter")
    _compile_fails({"mesh": one, "shard": {"layers.0.weight": ("model",)}},
                   r"parameter 'layers.0.weight' \(float32\[32, 16\]\) dimension 0 .*'model'")
    _compile_fails({"shard": {"x": ("data",)}}, "needs a mesh")
    _compile_fails({"mesh": Mesh({"model": 1}), "shard": data_parallel(Mesh({"data": 1}))}, "was made for")


def test_shardings_are_part_of_the_program_and_its_key():
    """On a one-device mesh (this process has one device): the annotations reach StableHLO and the keys."""
    events = []
    remove = driver.add_observer(events.append)
    try:
        x = torch.randn(4, 16)
        mesh = Mesh({"data": 1})
        results = {}
        for name, options in {
            "none": {},
            "rows": {"mesh": mesh, "shard": {"layers.0.weight": ("data", None)}},
            "cols": {"mesh": mesh, "shard": {"layers.0.weight": (None, "data")}},
        }.items():
            torch.manual_seed(0)
            model = _Net()
            with torch.no_grad():
                torch.testing.assert_close(compile_fn(model, **options)(x), model(x))
            results[name] = events[-1]
    finally:
        remove()
    assert len({e.key for e in results.values()}) == 3
    text = results["rows"].program.text()
    assert 'sdy.mesh @mesh = <["data"=1]>' in text
    assert 'sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>' in text
    assert 'sdy.sharding = #sdy.sharding<@mesh, [{}, {"data"}]>' in results["cols"].program.text()
    assert "sdy" not in results["none"].program.text()
    assert results["rows"].key_components != results["cols"].key_components


def test_a_submodule_output_gets_a_constraint():
    events = []
    remove = driver.add_observer(events.append)
    try:
        torch.manual_seed(0)
        model = _Net()
        x = torch.randn(4, 16, requires_grad=True)
        mesh = Mesh({"data": 1})
        compiled = compile_fn(model, mesh=mesh, shard={"layers.0:output": ("data", None)})
        torch.testing.assert_close(compiled(x), model(x))
    finally:
        remove()
    text = events[0].program.text()
    assert 'sdy.sharding_constraint' in text and '<@mesh, [{"data"}, {}]>' in text
    with pytest.raises(Exception, match=r"'layers\.7:output' matches no submodule"):
        compile_fn(_Net(), mesh=mesh, shard={"layers.7:output": ("data", None)})(x)
    with pytest.raises(Exception, match=r"value returned by 'layers.0:output' \(float32\[4, 32\]\)"):
        compile_fn(_Net(), mesh=mesh, shard={"layers.0:output": ("data", None, None)})(x)


def test_dumps_show_the_shardings(tmp_path):
    from tpucompile.debug import recorder as dump

    dump.start(tmp_path)
    try:
        mesh = Mesh({"data": 1})
        with torch.no_grad():
            compile_fn(_Net(), mesh=mesh, shard={"layers.1.weight": (None, "data")})(torch.randn(4, 16))
    finally:
        dump.stop()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (annotated,) = folder.glob("aten_*_annotate_shardings.txt")
    assert "shard_annotation" in annotated.read_text() and "mesh[data=1] dims[{},{data}]" in annotated.read_text()
    assert 'sdy.sharding = #sdy.sharding<@mesh, [{}, {"data"}]>' in (folder / "stablehlo.mlir").read_text()
    assert "sharding={" in (folder / "hlo.txt").read_text()


# -- SPMD runs in fresh processes ---------------------------------------------------------------------------


def _environment(tmp_path) -> dict[str, str]:
    environ = dict(os.environ)
    environ.pop("XLA_FLAGS", None)
    environ["TPUCOMPILE_CACHE_DIR"] = str(tmp_path / "cache")
    return environ


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """DP, TP and DP x TP runs of the GPT example on 8 virtual CPU devices, in one fresh process."""
    tmp_path = tmp_path_factory.mktemp("sharding")
    result = python_processes.run([sys.executable, WORKER, "gpt"], capture_output=True, text=True, timeout=900,
                                  env=_environment(tmp_path), cwd=HERE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def attention_runs(tmp_path_factory):
    """The attention kernel (interpret mode) on 8 virtual CPU devices under four meshes, in a fresh process."""
    tmp_path = tmp_path_factory.mktemp("attention")
    result = python_processes.run([sys.executable, WORKER, "attention"], capture_output=True, text=True,
                                  timeout=900, env=_environment(tmp_path), cwd=HERE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout, local_query", [("data", [1, 8, 128, 128]), ("heads", [8, 2, 128, 128]),
                                                 ("both", [4, 2, 128, 128]), ("neither", [2, 8, 128, 128])])
def test_the_attention_kernel_runs_per_shard(attention_runs, layout, local_query):
    """XLA's partitioner cannot split a Pallas kernel's custom call: each program runs the kernel inside a
    manual computation on its device's block (batch rows over a data axis, key/value heads over "model",
    whole where neither divides), forward and backward, with the values and gradients of one device."""
    run = attention_runs[layout]
    assert run["kernel"] == [True, True] and run["manual"] == [1, 1], run
    assert run["local_query"] == [local_query, local_query], run
    assert run["vs_single"] < 1e-4 and run["vs_eager"] < 1e-3, run


@pytest.mark.slow  # its fixture is the sharding worker's minutes-long run
def test_one_device_run_matches_eager(gpt_runs):
    single = gpt_runs["single"]["vs_eager"]
    assert single["logits"] < 1e-5 and single["losses"] < 1e-5 and single["params"] < 1e-4, single


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp", "tp", "dp_tp"])
def test_sharded_gpt_matches_one_device(gpt_runs, layout):
    run = gpt_runs[layout]
    diff = run["vs_single"]
    assert diff["logits"] < 1e-5, diff
    assert diff["losses"] < 1e-5, diff
    assert diff["params"] < 1e-4, diff  # AdamW moves a parameter by up to lr per step; rounding can tip it
    assert run["sharded_in_stablehlo"]
    assert len(run["keys"]) == 3  # inference, forward, backward
    assert run["executables"] >= 3
    assert sum(run["collectives"]) > 0, "XLA's partitioner inserted no collective"


@pytest.mark.slow
def test_submodule_outputs_the_plan_names_are_constrained(gpt_runs):
    # dp_tp's plan constrains what each block's MLP returns: a constraint per block in the inference and
    # forward programs, none in the backward (XLA propagates there)
    assert sorted(gpt_runs["dp_tp"]["constraints"]) == [0, 2, 2]
    assert gpt_runs["dp"]["constraints"] == [0, 0, 0]


@pytest.mark.slow
def test_each_layout_compiles_its_own_programs(gpt_runs):
    keys = [set(gpt_runs[layout]["keys"]) for layout in ("dp", "tp", "dp_tp")]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_fully_sharded_training_matches_one_device(gpt_runs, layout):
    """FSDP (and FSDP x TP), the optimiser step compiled too: logits, the first gradients, the losses, the
    parameters and AdamW's state after three steps equal the one-device run's."""
    run = gpt_runs["fsdp"][layout]
    diff = run["vs_single"]
    assert diff["logits"] < 1e-5 and diff["losses"] < 1e-5 and diff["gradients"] < 1e-5, diff
    assert diff["params"] < 1e-4 and diff["state"] < 1e-5, diff
    roles = [name.rsplit("(", 1)[1].rstrip(")") for name in run["graphs"]]
    assert roles == ["inference", "forward", "backward", "inference"], run["graphs"]  # the last: AdamW's step
    assert run["results_split"][2] == run["parameters"]  # every gradient comes back laid out as its parameter
    # the step updates parameters, exp_avg and exp_avg_sq where they lie: all split alike, nothing to exchange
    assert run["results_split"][3] == 3 * run["parameters"]
    assert run["collectives"][3] == {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}
    assert sum(run["collectives"][2].values()) > 0


@pytest.mark.slow
def test_rolled_fully_sharded_training_matches_one_device(gpt_runs):
    """The layers rolled under FSDP: the backward returns each stacked gradient once, gathered from its
    shards, and every layer's gradient is a view of it; the same values as one device."""
    run = gpt_runs["fsdp"]["fsdp_rolled"]
    diff = run["vs_single"]
    assert diff["logits"] < 1e-5 and diff["losses"] < 1e-5 and diff["gradients"] < 1e-5, diff
    assert diff["params"] < 1e-4 and diff["state"] < 1e-5, diff
    assert run["layer_parts"] == [0, 0, 2 * 12, 0], run["layer_parts"]  # 12 weights per block, 2 blocks


@pytest.mark.slow
def test_a_fully_sharded_prewarm_writes_the_keys_a_run_on_real_weights_looks_up(gpt_runs):
    keys = gpt_runs["fsdp"]["prewarm_keys"]
    if "skipped" in keys:
        pytest.skip(keys["skipped"])
    assert [role for role, _, _ in keys["meta"]] == ["forward", "backward", "inference"]
    assert all(error is None for _, _, error in keys["meta"] + keys["cpu"])
    assert keys["meta"] == keys["cpu"]


@pytest.mark.slow
def test_unchanged_parameters_are_not_sent_again(gpt_runs):
    reuse = gpt_runs["reuse"]
    assert reuse["first"] == reuse["parameters"] + 1  # every parameter, and the tokens
    assert reuse["second"] == 1  # new tokens only
    assert reuse["after_update"] == 1  # the updated parameter (the tokens of the first call are still placed)


@pytest.mark.slow
def test_an_output_the_plan_names_stays_split(gpt_runs):
    kept = gpt_runs["kept_output"]
    assert kept["diff"] < 1e-5
    assert kept["dims"] == [["data"], []]  # the program returns it split over the data axis
    assert kept["consumer_placements"] == 0  # the next program takes the device parts as they are


@pytest.mark.slow
def test_mesh_shards_are_counted_per_device_and_go_with_the_model(gpt_runs):
    """Data parallel over 8 devices: each device holds a replica of the parameters, counted on it; after a
    model is dropped (with ``torch._dynamo.reset()``) its parameters are gone and the held memory is what
    it was after the first one went."""
    memory = gpt_runs["memory"]
    for (while_alive, freed), parameter_bytes in zip(memory["parameters_while_alive"], memory["parameter_bytes"],
                                                     strict=True):
        assert while_alive == 8 * parameter_bytes, (while_alive, parameter_bytes)
        assert freed
    first = memory["held_after"][0]
    assert all(held == first for held in memory["held_after"]), memory["held_after"]
    assert first["parameters"] == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_processes(scenario: str, tmp_path, *extra: str) -> list[dict]:
    """Run ``scenario`` of the worker as processes 0 and 1, on loopback; their JSON reports."""
    port = _free_port()
    environ = _environment(tmp_path)
    workers = [python_processes.popen([sys.executable, WORKER, scenario, str(i), str(port), str(tmp_path / "cache"),
                                 *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, cwd=HERE)
               for i in range(2)]
    outputs = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=600)
            assert worker.returncode == 0, stdout[-3000:] + stderr[-5000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp_tp", "fsdp"])
def test_two_processes_share_one_mesh(tmp_path, plan):
    """2 processes x 4 CPU devices, coordinated by jax.distributed on loopback: a DP x TP (or FSDP) GPT run in
    each, one compile per program between them (the other process finds it in the shared cache)."""
    outputs = _two_processes("host", tmp_path, plan)
    assert sorted(o["process"] for o in outputs) == [0, 1]
    for output in outputs:
        assert (output["processes"], output["local_devices"], output["devices"]) == (2, 4, 8)
        diff = output["vs_eager"]
        assert diff["logits"] < 1e-5 and diff["losses"] < 1e-5 and diff["params"] < 1e-4, diff
    assert outputs[0]["losses"] == outputs[1]["losses"]
    compiles = [c for o in outputs for c in o["compiles"]]
    keys = {c["key"] for c in compiles}
    assert len(keys) == 3 and len(compiles) == 6
    for key in keys:
        hits = [c["hit"] for c in compiles if c["key"] == key]
        assert sorted(hits) == [False, True], f"{key}: compiled in both processes ({hits})"


@pytest.mark.slow
def test_dtensor_placements_are_the_plan(tmp_path):
    """Two torch ranks (gloo) with one device each: a tensor-parallel MLP whose parameters are DTensors compiles
    with no plan at all, returns DTensors, and trains like the eager DTensor program."""
    reports = _two_processes("dtensor", tmp_path)
    for report in reports:
        assert report["compiled_output_type"] == "DTensor"
        assert report["compiled_grad_type"] == "DTensor"
        assert report["compiled_grad_placements"] == report["eager_grad_placements"] == "(Shard(dim=0),)"
        assert report["output"] < 1e-5
        eager, compiled = report["losses"]
        assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-5
        assert report["params"] < 1e-5
        assert report["sharded_programs"] == 3  # inference, forward and backward, split as the placements say


@pytest.mark.slow
def test_llama_example_runs_on_a_mesh(tmp_path):
    environ = _environment(tmp_path)
    environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    result = python_processes.run([sys.executable, os.path.join(ROOT, "examples", "llama.py"), "--mesh",
                             "data=2,model=4"], capture_output=True, text=True, timeout=900, env=environ)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "agreement with one device" in result.stdout, result.stdout
