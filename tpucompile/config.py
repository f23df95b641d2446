"""Backend options: one frozen dataclass built from ``torch.compile(options=...)`` and ``TPUCOMPILE_*``.

Options given to ``torch.compile`` win over environment variables, which win over the defaults. An unknown
option is refused with the list of valid ones, so a typo never silently compiles with defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from tpucompile.contracts.target_names import parse as parse_target
from tpucompile.errors import OptionsError
from tpucompile.sharding.plan import Mesh, ShardPlan, mesh_option, shard_option

ENV_PREFIX = "TPUCOMPILE_"


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything that changes how a graph is compiled or run."""

    platform: str | None = None
    """PJRT platform to compile for and run on ("cpu", "cuda", "tpu"); None takes jax's default backend."""

    targets: tuple[str, ...] = ()
    """Extra targets every graph is also compiled for and stored in the cache, never run here: TPU slices by
    topology ("tpu:v5e:2x2", compiled without a TPU) or other platforms of this machine ("cuda")."""

    compile_only: bool = False
    """Compile every graph for ``targets`` and store it, run nothing here: outputs are ``meta`` tensors of the
    right shapes and dtypes, so a whole training step runs through. Implied when the inputs are ``meta``
    tensors and ``targets`` are given (a model built under ``torch.device("meta")`` never holds weights)."""

    embed_constant_limit: int = 1024
    """Tensor constants with at most this many elements are embedded in the program; larger ones are passed
    as runtime arguments so they do not bloat the program text or its cache key."""

    executable_cache_size: int = 256
    """How many loaded executables (and lowered programs, and plans) the in-process cache keeps for the models
    compiled with these options, least recently used dropped first. It bounds this model only: another
    model's entries count against that model's own limit (models with equal options share one)."""

    max_shape_specializations: int = 64
    """How many concrete-shape executables one symbolic graph keeps before the least recently used is
    dropped (each extra shape is a recompile, logged with its reason)."""

    dynamic_mode: str = "auto"
    """How a graph with symbolic sizes is compiled: "bucket" (one executable per bucket of sizes, the inputs
    padded to it and the padding made invisible to the program, so results are those of the exact sizes),
    "exact" (one per concrete size), or "auto", the default: per bucket wherever that is exact, else per size.
    A graph with an op that padding would make inexact, or on a device mesh, is compiled per size; "bucket"
    then warns once, naming the op, "auto" says so in the log (INFO). Buckets are the default because on an
    accelerator each new size is a compile, while XLA's TPU estimate puts the bucketed programs of
    ``bench/buckets.py`` at or under the exact-size ones."""

    buckets: tuple[Any, ...] = ()
    """The sizes a dynamic dimension is padded to under ``dynamic_mode="bucket"`` (the smallest that holds
    it; a size past the largest gets its own executable); empty: powers of two from ``bucket_minimum``. Per
    input, a dict keyed by the compiled function's argument name (every dynamic dimension of it) or
    ``"name:dim"``: ``{"input_ids": [64, 256, 1024]}``; dimensions it does not name take powers of two. Held
    as sorted sizes, or as sorted ``(key, sizes)`` pairs for the dict."""

    bucket_minimum: int = 16
    """The smallest power-of-two bucket, so that small sizes share one executable."""

    bucket_unmerged_products: bool = True
    """In bucketed programs, matrix products take a view that merges a runtime-sized dimension inside others
    (``linear`` on a (batch, sequence, features) input) as the unmerged tensor, instead of the merge, which
    XLA's padder compiles into packing the actual rows on every call (``lowering/unmerged.py``)."""

    bucket_products_on_padding: bool | str = "auto"
    """In bucketed programs, a product of an unmerged view whose runtime-sized dimensions are all free
    (``linear``'s forward) runs over the whole bucket, its operand's runtime sizes dropped and its result
    marked again: XLA's CPU compiler would merge the free dimensions and pack the actual rows before it and
    unpack them after, on every call (``lowering/unmerged.py``). "auto": for programs lowered for the CPU,
    where it makes a step faster; XLA's TPU compiler keeps such products unmerged, and runs the whole-bucket
    form a few percent slower by its estimate (``docs/benchmarks.md``)."""

    bucket_fixed_shapes_in_place: bool = True
    """In bucketed programs, a runtime-sized value that has to leave XLA's size tracking (a program result,
    such as each value a training forward saves for its backward; an FFT's or a sort's operand) is given a
    fixed shape where it lies, padding included, by a scatter over a constant that XLA's padder makes static
    and its simplifier removes; False copies it through an identity gather (``lowering/dynamic_sizes``), as
    programs lowered for platforms other than ``FIXED_IN_PLACE_PLATFORMS`` always do."""

    bucket_saved_padded: bool = True
    """A bucketed forward hands the values it saves for a bucketed backward over padded to its bucket, as its
    program returned them, instead of cutting each to its actual size (a copy) for the backward to pad again
    (another); the backward's program ignores the padding (``contracts/saved_handoff``)."""

    bucket_saved_unmerged: bool = True
    """A bucketed training forward hands a saved view that merges the padded length into the rows of a matrix
    (a linear layer's input, ``(b, s, k) -> (b*s, k)``, saved for the weight's gradient) over as the value it
    views, merged again in the backward, instead of the view, which XLA's padder writes out with the actual
    rows packed to the front (a gather per saved value). Applies with ``saved_transposes_as_bases``."""

    bucket_staged_inputs: bool = True
    """On the CPU, a bucketed call writes each padded input into one tensor per bucket and input, imported
    into PJRT once, instead of padding a new tensor that is imported on every call (``runtime/staged_inputs``):
    the same values, ~10 us less per call of a small step. False pads a new tensor per call."""

    bucket_reuse_padded_results: bool = True
    """A bucketed result that comes back as a bucketed graph's input (a key/value cache, extended by each
    decoding step and read by the next) goes to the program as the padded buffer it was cut from, instead of
    being padded again (a copy of the whole value per call): the programs ignore what the padding holds. An
    argument that a result extends by a few positions is taken padded past its bucket by them, so the result
    fits the next call, and the concatenation that extends it writes into the argument's buffer in place
    (``runtime/padded_results``, ``lowering/grown_in_place``). An output's padded buffers are held beside its
    cuts only once one of them has come back. False pads every input anew to its bucket."""

    stacked_layer_outputs: bool = True
    """Graph outputs that are, together, every layer of one stacked result of a rolled loop (a rolled
    backward's gradients of the layers' weights, where they are stacked in the program: under a mesh, with
    ``stacked_parameters`` off) are returned as that stacked result, once, and each output is
    a view of its layer; False returns each layer as a result of its own, which XLA copies out of the loop's
    stacked buffer, so the buffer counts among the program's temporaries and they grow with depth
    (``lowering/graph.py``, ``docs/benchmarks.md``)."""

    compact_embedding_grad: bool = True
    """The gradient of a bf16/f16 embedding table is summed in f32 per distinct token id in a buffer of the
    tokens' size, and each id's rounded sum added into a table of the weight's dtype; False takes PyTorch's
    decomposition, which fills and rounds a whole f32 copy of the table (the same values up to the order of
    the f32 sums; ``frontend/decompositions.py``). Sharded programs (``mesh``) keep PyTorch's form."""

    narrow_products: bool | str = "auto"
    """bf16/f16 matrix products (``mm``, ``bmm``, ``mv``, ``dot``) write their result in their own dtype,
    accumulated in f32 and rounded once, as a JAX program's products are; products with a bias (``addmm``)
    keep an f32 product, add the bias and round once. False: every product is an f32 product and a convert
    (the same values up to the order of the f32 sums). "auto" (the default): narrow in every program that
    holds a forward (inference, the forward of a training step, a whole step traced with ``torch.func``),
    f32 in the backward program of a split step. Measured on the TPU target (``docs/benchmarks.md``): narrow
    products take 2-9% of XLA's estimated cycles off the forwards and whole steps, while the split backwards,
    which read the forward's saved bf16 values as arguments, gain bytes and peak memory
    (``lowering/rules/matmul.py``)."""

    sum_concat_by_part: bool = True
    """A sum over a concatenation that keeps the concatenated dim is taken per part and the sums
    concatenated (``passes/concat_sums.py``): the bias gradient of a fused query/key/value projection then
    reads each part's gradient where it lies instead of a reduce of its own over the written concatenation
    (1.7% of XLA's estimated cycles on the example GPT's training step on a v5e). The same sums, in another
    order. False sums the concatenation whole."""

    saved_transposes_as_bases: bool = True
    """A training step's forward hands the backward the base of a transposed view it would save for a matrix
    product (the weight gradient's ``x.t()``), and the backward takes the view again, as the product's
    dimension numbers (``passes/saved_transposes.py``): a program returns its results in their default layout,
    so a saved transpose is a transposing copy at the end of the forward. False saves what the min-cut
    partition chose. The same values either way."""

    recompute_product_operands: bool = False
    """Peak memory for cycles, on request: a training step's partition may recompute in the backward a value a
    matrix product reads (SwiGLU's ``silu(gate) * up``, an RMSNorm's output) instead of saving it, and the
    backward computes each layer's parameter gradients before the next layer's products
    (``passes/gradient_order.py``). False keeps AOTAutograd's rule, made for Inductor, whose products cannot
    read through elementwise ops: every value a product reads is saved. XLA's TPU compiler computes such a
    value inside the product's operand. Measured on a v5e (``docs/benchmarks.md``), a 0.86B Llama's training
    step: saved 8106 -> 5642 MiB, peak 11992 -> 9671 MiB, HBM bytes 133.3 -> 112.7 GB, estimated cycles
    449 -> 512M (the ordering makes XLA write out operands it fused into the products)."""

    roll_layers: bool | str = "auto"
    """Runs of identical layers (the items of an ``nn.ModuleList`` a model loops over) are compiled as one loop
    over their parameters stacked per layer, forward and backward (``frontend/layer_rolling.py``): XLA
    compiles one layer instead of every one. False hands XLA every layer unrolled, as Dynamo traced them.
    "auto": rolled unless a compile target is a TPU, where XLA's estimate of a rolled training step is still
    above the unrolled one's (``docs/benchmarks.md``), and unless the graph is sharded over a mesh
    (``roll_layers_for``); True rolls there too (a deep model's plan compiles in a fraction of the time). The
    graph dump says which runs were rolled and why others were not."""

    stacked_parameters: bool = True
    """A rolled run's parameters are stacked once, outside the program: each layer's parameter becomes a view
    of one buffer the loop reads as it lies, and optimisers update them in place there
    (``frontend/parameter_stacks.py``); False stacks them inside the program, a copy of every rolled weight on
    every call. Parameters that cannot be views of such a buffer, and sharded programs, are stacked in the
    program either way."""

    grouped_query_attention: bool = True
    """Attention in its math form whose keys and values serve groups of query heads (Hugging Face's
    ``repeat_kv`` expansion, or ``enable_gqa``) is computed per key/value head, each group's queries as rows of
    one product (``decompositions.grouped_query_attention``), so the keys and values are never copied per query
    head: a decoding step reads its cache once per key/value head, and the keys' and values' gradients come
    out of the products summed. False computes it on the repeated keys and values, as the model wrote it.
    Measured in ``docs/benchmarks.md``."""

    prescale_attention_query: bool = True
    """On the attention kernel's route (a TPU target), the query is multiplied by the attention's scale as an
    op of the graph and the kernel runs with scale 1, so the forward saves the scaled query and XLA fuses the
    multiply into the query's producer (its split and transpose); False scales it inside the kernel's lowering,
    a separate pass over the query in the forward and another in the backward (the same values up to one
    rounding of the query gradient). Measured on the TPU target in ``docs/benchmarks.md``."""

    narrow_elementwise: bool = True
    """bf16/f16 elementwise ops that round the same computed in their operands' own dtype as in f32 (add,
    subtract and multiply without scaling, squares, negation, abs, max/min/clamp, comparisons) are emitted in
    that dtype, and XLA widens them inside its fusions as it needs; other bf16/f16 ops are computed in f32 and
    rounded once, as PyTorch does. With explicit converts around every narrow op, XLA's TPU compiler fuses the
    widening of a value into the fusion that makes it and keeps the f32 copy in HBM until the backward reads
    it (Hugging Face Llama at 1B, whole step: peak memory 1.74x -> 1.19x of hand-written JAX,
    ``docs/benchmarks.md``). Given narrow ops, XLA may skip the rounding between two of them (its excess
    precision, on by default: the TPU compiler computes a chain of them in f32 and rounds once at its end, the
    CPU compiler does so in some fusions), as Inductor's fused kernels do; results then differ from eager's
    by those roundings. False: every bf16/f16 op is computed in f32 between explicit converts, rounded where
    PyTorch rounds."""

    verify: bool = True
    """Run the MLIR verifier on every lowered module before compiling it."""

    fallback: str = "eager"
    """What to do with an op or dtype tpucompile cannot lower: "eager" runs it in PyTorch between compiled
    regions (with one warning per op), "error" raises ``UnsupportedOpError``."""

    attention: str = "auto"
    """How ``scaled_dot_product_attention`` is compiled: "auto" (a flash-attention kernel where the program is
    compiled for a TPU, by ``targets`` or on a TPU host, and the call's shapes fit it; the math form
    elsewhere), "kernel" (the kernel's op wherever shapes fit; platforms without the kernel lower it to the
    math form, recomputing the scores in the backward), "math" (always the math form), or "interpret" (the
    kernel's op wherever shapes fit, lowered on every platform to the TPU kernel run by Pallas' interpreter:
    slow, for checking the kernel's values where no TPU is)."""

    donate: bool = True
    """Let programs take over the memory of arguments nothing else reads after them: values the forward saved
    that only the backward reads, and arguments a graph updates in place (an optimiser step, running
    statistics), whose new values then take their memory, as ``jax.jit``'s ``donate_argnums`` does. Never a
    tensor the user holds, never while autograd may run the backward again (``retain_graph``)."""

    activation_memory_budget: float | str = "auto"
    """What the forward of a training graph may save for its backward, as a fraction of what the min-cut
    partition saves when it recomputes nothing costly (AOTAutograd's ``activation_memory_budget``): below 1,
    the backward recomputes more (matrix products too) to hold less between the two programs. 1 saves the
    least memory traffic; on a TPU target 0.5 roughly halves the saved bytes of a GPT block for about 10% more
    flops and bytes (``docs/benchmarks.md``). "auto": 1 unless the step's estimated peak exceeds the HBM of a
    chip of the targets, then, with the values passed between repeated blocks saved, the largest budget whose
    estimate fits (``frontend/activation_budget.py``); the step report says what was chosen. With rolled layers
    (``roll_layers``) the budget applies inside each layer's loop body: its backward recomputes its own
    values, and what the loops stack for the backward is saved."""

    host_kernels: str = "auto"
    """Which matrix products and f32 convolutions of CPU programs call the host BLAS kernels instead of XLA's
    own: "auto" (each op where it was measured faster on this machine), "on" (every op they take), "off"."""

    cpu_depthwise_taps: bool = True
    """Programs compiled for this process's CPU write each depthwise convolution (one input feature per group)
    and its kernel gradient as sums over the kernel's taps (``runtime/depthwise``): XLA's CPU grouped
    convolutions take seconds where eager takes milliseconds (timm's FastViT-T8 training step: 40x eager's).
    The stored StableHLO and every other target keep the convolution. False compiles XLA's convolution."""

    host_kernel_timing: str = "background"
    """Where "auto" checks a whole program with the ops that won alone (the ops themselves are timed before the
    compile either way): "background" (the program first runs with XLA's ops; a worker thread compiles it with
    the chosen ops, its next calls alternate between the two, and the faster stays) or "inline" (both
    programs compiled and timed on example inputs before the first compile, which waits for them)."""

    cache_dir: str | None = None
    """Directory of the persistent compile cache; None means ``$XDG_CACHE_HOME/tpucompile`` or
    ``~/.cache/tpucompile``."""

    cache_mode: str = "read-write"
    """"read-write" (default), "read-only" (use entries, never write), "off" (in-process cache only) or
    "strict" (any XLA compile is an error: ``CacheMissError`` names the graph and the key)."""

    cache_remote: str | None = None
    """Optional shared tier behind the local directory: an fsspec URL (``file://``, ``s3://``…) or
    ``redis://host:port/db``. Its errors never fail a compile."""

    cache_max_size: str | None = None
    """Size cap of the local cache directory ("2GB", "500MB", bytes); the least valuable entries (hits *
    compile time / size) are evicted past it. None: no cap."""

    cache_remote_timeout: int = 3
    """Seconds one remote cache operation may take before the remote tier is skipped for a while."""

    cache_remote_lease: float = 60.0
    """Seconds a host's claim on a key in the remote tier lasts (renewed every third of it while the host
    compiles): with ``cache_remote``, one host of a fleet compiles a key and the others load its entry; a
    host that dies holding a claim delays the others by at most this long."""

    cache_remote_wait: float = 1800.0
    """Seconds a host waits for another host's compile of a key before compiling it itself."""

    mesh: Mesh | None = None
    """Run each graph as one SPMD program over a device mesh (``tpucompile.Mesh({"data": 2, "model": 4})``,
    or ``"data=2,model=4"``); None runs on one device."""

    shard: ShardPlan | None = None
    """How parameters and inputs are laid over ``mesh``: a ``ShardPlan`` (``data_parallel(mesh)``,
    ``tensor_parallel(mesh, ...)``) or a mapping of names to dims such as ``{"idx": ("data", None)}``. Anything
    it does not name is replicated. ``DTensor`` inputs need no plan: their placements are read as one."""

    coordinator: str | None = None
    """``host:port`` of the ``jax.distributed`` coordinator when ``num_processes`` > 1; None takes
    ``MASTER_ADDR`` and ``MASTER_PORT`` + 1 (torch.distributed's store has ``MASTER_PORT``), then jax's own
    detection."""

    num_processes: int = 1
    """How many processes (hosts) share the mesh; above 1, ``jax.distributed`` is initialised before the first
    compile."""

    process_id: int | None = None
    """This process's index among ``num_processes``; None takes ``RANK``, then jax's own detection."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_sources(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Options:
        """Combine defaults, ``TPUCOMPILE_<NAME>`` environment variables and explicit options."""
        environ = effective_environ() if environ is None else environ
        valid = cls.field_names()
        values: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in valid:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw:
                values[name] = _parse_env(name, raw, fields[name].type)
        for name, value in (options or {}).items():
            if name not in fields:
                raise OptionsError(
                    f"unknown tpucompile option {name!r}; valid options are: {', '.join(sorted(valid))}"
                )
            values[name] = _check_type(name, value, fields[name].type)
        return cls(**values)


_overrides: dict[str, str] = {}


@contextlib.contextmanager
def environment_overrides(**values: str) -> Iterator[None]:
    """Within the block, options read from the environment see ``values`` (option name → the text its
    ``TPUCOMPILE_<NAME>`` variable would hold) in place of those variables, in this whole process.

    How the command line configures a script it runs in its own process without writing to ``os.environ``:
    explicit ``torch.compile`` options still win, and the earlier overrides are back when the block ends.
    """
    global _overrides
    unknown = sorted(set(values) - set(Options.field_names()))
    if unknown:
        raise OptionsError(f"unknown tpucompile option(s) {', '.join(unknown)}")
    saved = _overrides
    _overrides = {**saved, **values}
    try:
        yield
    finally:
        _overrides = saved


def effective_environ() -> Mapping[str, str]:
    """``os.environ`` as options read it: with the ``environment_overrides`` in force applied."""
    if not _overrides:
        return os.environ
    return {**os.environ, **{ENV_PREFIX + name.upper(): value for name, value in _overrides.items()}}


CACHE_MODES = ("read-write", "read-only", "off", "strict")
"""The values of ``cache_mode`` (the persistent cache enforces them too)."""
HOST_KERNEL_MODES = ("auto", "on", "off")
"""The values of ``host_kernels``."""
HOST_KERNEL_TIMINGS = ("background", "inline")
"""The values of ``host_kernel_timing``."""
ATTENTION_MODES = ("auto", "kernel", "math", "interpret")
"""The values of ``attention``."""
DYNAMIC_MODES = ("auto", "bucket", "exact")
"""The values of ``dynamic_mode``."""
_CHOICES = {"dynamic_mode": DYNAMIC_MODES, "fallback": ("eager", "error"), "attention": ATTENTION_MODES,
            "host_kernels": HOST_KERNEL_MODES, "host_kernel_timing": HOST_KERNEL_TIMINGS,
            "cache_mode": CACHE_MODES}

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``2GB``, ``512MiB`` or ``1000000`` (decimal units, binary with ``iB``)."""
    number, unit = text.strip(), ""
    for index, char in enumerate(number):
        if not (char.isdigit() or char == "."):
            number, unit = number[:index], number[index:].strip().upper()
            break
    if not number or unit not in _SIZE_UNITS:
        raise OptionsError(f"{text!r} is not a size (use e.g. 2GB, 500MB, 1GiB or a number of bytes)")
    return int(float(number) * _SIZE_UNITS[unit])


def _check_type(name: str, value: Any, annotation: str) -> Any:
    if name == "activation_memory_budget":
        return _activation_budget(value)
    if name in ("narrow_products", "roll_layers", "bucket_products_on_padding"):
        return _bool_or_auto(name, value)
    if name in _CHOICES and value not in _CHOICES[name]:
        raise OptionsError(f"tpucompile option {name!r} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
    if annotation == "bool" and not isinstance(value, bool):
        raise OptionsError(f"tpucompile option {name!r} must be a bool, got {value!r}")
    if annotation == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise OptionsError(f"tpucompile option {name!r} must be a non-negative int, got {value!r}")
    if annotation == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionsError(f"tpucompile option {name!r} must be a number, got {value!r}")
        value = float(value)
        if name == "cache_remote_lease" and not value > 0:
            raise OptionsError(f"tpucompile option {name!r} must be a positive number of seconds, got {value!r}")
        if name == "cache_remote_wait" and not value >= 0:
            raise OptionsError(f"tpucompile option {name!r} must be a number of seconds >= 0, got {value!r}")
    if annotation == "str | None" and value is not None and not isinstance(value, str):
        raise OptionsError(f"tpucompile option {name!r} must be a string, got {value!r}")
    if annotation == "int | None" and value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 0
    ):
        raise OptionsError(f"tpucompile option {name!r} must be a non-negative int or None, got {value!r}")
    if name == "num_processes" and value < 1:
        raise OptionsError(f"tpucompile option 'num_processes' must be at least 1, got {value!r}")
    if name == "buckets" and isinstance(value, dict):
        return tuple(sorted((_bucket_key(key), _check_type(name, sizes, "tuple[int, ...]"))
                            for key, sizes in value.items()))
    if annotation == "tuple[int, ...]" or name == "buckets":
        sizes = value.split(",") if isinstance(value, str) else value
        try:
            sizes = tuple(sorted({int(size) for size in sizes if str(size).strip()}))
        except (TypeError, ValueError):
            raise OptionsError(f"tpucompile option {name!r} must be a list of sizes, got {value!r}") from None
        if any(size < 1 for size in sizes):
            raise OptionsError(f"tpucompile option {name!r} must hold positive sizes, got {value!r}")
        return sizes
    if annotation == "tuple[str, ...]":
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise OptionsError(f"tpucompile option {name!r} must be a list of target names, got {value!r}")
        return tuple(dict.fromkeys(str(parse_target(n)) for n in names if n.strip()))
    if name == "cache_max_size" and value is not None:
        parse_size(value)
    if name == "mesh":
        return mesh_option(value)
    if name == "shard":
        return shard_option(value)
    return value


def _activation_budget(value: Any) -> float | str:
    """"auto", or a fraction between 0 and 1 (a number, or its text from the environment)."""
    if value == "auto":
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    is_number = isinstance(number, (int, float)) and not isinstance(number, bool)
    if not is_number or not 0.0 <= number <= 1.0:
        what = "out of range" if is_number else "not a number"
        raise OptionsError(f"tpucompile option 'activation_memory_budget' must be \"auto\" or a number between 0 "
                           f"and 1, got {value!r} ({what})")
    return float(number)


def _bool_or_auto(name: str, value: Any) -> bool | str:
    """True, False or "auto" (also from the environment's text: 1/0, true/false, auto)."""
    if isinstance(value, str):
        value = _BOOL_TEXT.get(value.strip().lower(), value.strip().lower())
    if not (isinstance(value, bool) or value == "auto"):
        raise OptionsError(f"tpucompile option {name!r} must be true, false or \"auto\", got {value!r}")
    return value


def roll_layers_for(setting: bool | str, platforms: Iterable[str], mesh: Any) -> bool:
    """Whether a compile whose graphs are lowered for ``platforms`` ("cpu", "tpu", ...) rolls repeated layers
    under the ``roll_layers`` ``setting``. "auto" leaves unrolled what rolling does not serve yet: TPU programs
    (XLA's estimate of a rolled step is above the unrolled one's) and sharded programs (plans that name a
    layer's outputs, stacked weights' shardings)."""
    if isinstance(setting, bool):
        return setting
    return "tpu" not in platforms and mesh is None


def narrow_products_for(setting: bool | str, role: str) -> bool:
    """Whether the program of an AOTAutograd graph of ``role`` ("inference", "forward" or "backward")
    writes its products narrow under the ``narrow_products`` ``setting``."""
    return setting if isinstance(setting, bool) else role != "backward"


FIXED_IN_PLACE_PLATFORMS = frozenset({"cpu", "tpu"})
"""Platforms whose XLA was seen to give a scatter over a constant a fixed shape (``bucket_fixed_shapes_in_place``;
``tests/runtime/test_buckets.py`` checks the CPU's and a TPU target's compiled programs)."""


def fixed_shapes_in_place_for(setting: bool, platform: str) -> bool:
    """Whether bucketed programs lowered for ``platform`` give runtime-sized results a fixed shape in place
    under the ``bucket_fixed_shapes_in_place`` ``setting``: elsewhere (a GPU, not checked) they are copied."""
    return setting and platform in FIXED_IN_PLACE_PLATFORMS


def products_on_padding_for(setting: bool | str, platform: str) -> bool:
    """Whether bucketed programs lowered for ``platform`` run products over the whole bucket under the
    ``bucket_products_on_padding`` ``setting``."""
    return setting if isinstance(setting, bool) else platform == "cpu"


def compact_embedding_grad_for(setting: bool, mesh: Any) -> bool:
    """Whether programs sum embedding gradients per token id under the ``compact_embedding_grad`` ``setting``:
    not in sharded programs (a ``mesh``), where the sort and the per-id sums would gather every chip's tokens
    and rows (not measured there; PyTorch's form reduces the table instead)."""
    return setting and mesh is None


def _bucket_key(key: Any) -> str:
    """``"name"`` or ``"name:dim"`` (also from a ``(name, dim)`` pair) of a per-input ``buckets`` entry."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int):
        key = f"{key[0]}:{key[1]}"
    if not isinstance(key, str) or not key or key.count(":") > 1 or (
            ":" in key and not key.split(":")[1].isdigit()):
        raise OptionsError(f"tpucompile option 'buckets' keys are argument names or 'name:dim', got {key!r}")
    return key


_BOOL_TEXT = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""How the environment writes a bool option (lower-cased)."""


def _parse_env(name: str, raw: str, annotation: str) -> Any:
    var = ENV_PREFIX + name.upper()
    if annotation == "bool":
        if raw.strip().lower() in _BOOL_TEXT:
            return _BOOL_TEXT[raw.strip().lower()]
        raise OptionsError(f"{var}={raw!r} is not a boolean (use 1/0, true/false)")
    if annotation in ("int", "int | None"):
        try:
            return _check_type(name, int(raw), annotation)
        except ValueError:
            raise OptionsError(f"{var}={raw!r} is not an integer") from None
    if annotation == "float":
        try:
            return _check_type(name, float(raw), annotation)
        except ValueError:
            raise OptionsError(f"{var}={raw!r} is not a number") from None
    return _check_type(name, raw, annotation)
