"""Analysis.peak_bytes predicts the target's compiled peak (issue 21).

The predicted peak of a zoo train step (state donated), for the compiler the arguments are
placed on, is within 10% of ``argument + output + temp - alias`` of that compiler's
``memory_analysis()`` (deterministic compiled figures) on CPU and on the H100 target. The
full table over the zoo is ``python -m benchmarks.prediction`` (docs/targets.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

import jaxmem
from benchmarks import zoo
from jaxmem import measure, targets
from jaxmem.analyzing import fusion

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    return targets.require("h100")  # fails (TargetError with the pip command) without plugin


@pytest.mark.parametrize("name", ["mlp", "densenet", "llama"])
@pytest.mark.parametrize("where", ["cpu", "h100"])
def test_predicted_peak_within_10_percent_of_the_targets_compiled_peak(h100, name, where):
    w = zoo.make(name, size="test", abstract=True)
    args = w.args if where == "cpu" else targets.place(w.args, h100)
    predicted = jaxmem.analyze(w.step, *args, donate_argnums=0)
    compiled = measure.figures(measure.compile(
        jax.jit(w.step, donate_argnums=0).lower(*args))).peak
    assert predicted.platform == ("cpu" if where == "cpu" else "cuda")
    assert predicted.peak_bytes == pytest.approx(compiled, rel=0.10)


def test_the_target_is_an_input():
    """The same step predicted for XLA:CPU and XLA:GPU: GPU fuses what CPU stores."""
    w = zoo.make("resnet", size="test", abstract=True)
    cpu = jaxmem.analyze(w.step, *w.args, donate_argnums=0, target="cpu")
    gpu = jaxmem.analyze(w.step, *w.args, donate_argnums=0, target="h100")
    assert (cpu.platform, gpu.platform) == ("cpu", "cuda")
    assert gpu.peak_bytes < cpu.peak_bytes


def test_donated_outputs_cost_nothing():
    w = zoo.make("mlp", size="test", abstract=True)
    kept = jaxmem.analyze(w.step, *w.args)
    donated = jaxmem.analyze(w.step, *w.args, donate_argnums=0)
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(w.state))
    assert kept.peak_bytes - donated.peak_bytes > 0.5 * state


def test_fusion_rules_per_platform():
    assert fusion.is_expensive("tanh", "float32", "cpu")
    assert not fusion.is_expensive("tanh", "float32", "cuda")
    assert fusion.upcast_bytes("dot_general", "bfloat16", 100, "cpu") == 200
    assert fusion.upcast_bytes("dot_general", "bfloat16", 100, "cuda") == 0
    assert fusion.makes_buffer("random_bits", ("key<rbg>",), "cpu")
    assert not fusion.makes_buffer("random_bits", ("key<rbg>",), "cuda")


def test_gpu_gemm_fusions_take_activation_conversions():
    """XLA:GPU's GEMM fusion converts a computed operand to bf16 inside the kernel (the
    attention probabilities), while a weight's bf16 cast is stored; XLA:CPU stores both."""
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import materialised

    assert fusion.fuses_into_gemm("convert_element_type", "bfloat16", (False,), "cuda")
    assert not fusion.fuses_into_gemm("convert_element_type", "bfloat16", (True,), "cuda")
    assert not fusion.fuses_into_gemm("convert_element_type", "bfloat16", (False,), "cpu")
    assert not fusion.fuses_into_gemm("convert_element_type", "float32", (False,), "cuda")

    def f(w, x, v):
        p = jax.nn.softmax(x @ w)
        return p.astype(jax.numpy.bfloat16) @ v.astype(jax.numpy.bfloat16)

    a = jax.ShapeDtypeStruct((64, 64), jax.numpy.float32)
    prog = trace(f, a, a, a)
    casts = [n for n in prog.nodes if n.primitive == "convert_element_type"]
    probs = next(n for n in casts if prog.values[n.inputs[0]].producer is not None)
    weight = next(n for n in casts if prog.values[n.inputs[0]].producer is None)
    gpu, cpu = materialised(prog, "cuda"), materialised(prog, "cpu")
    assert not gpu[probs.outputs[0]] and gpu[weight.outputs[0]]
    assert cpu[probs.outputs[0]] and cpu[weight.outputs[0]]


def test_gpu_gemms_read_a_transposed_weight_in_place():
    """XLA:GPU folds a transpose read only by matmuls into them (GPT-2's ``x @ kernel.T``):
    no buffer of its own, so a transposed weight read again by the backward matmul is not
    counted twice; XLA:CPU's figure stores it, and so does the cost model's view of the
    residuals (``fold_dots=False``)."""
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import liveness, materialised

    assert fusion.folds_into_dot("transpose", "cuda")
    assert not fusion.folds_into_dot("transpose", "cpu")
    assert not fusion.folds_into_dot("reshape", "cuda")

    def loss(w1, w2, x):  # two layers: the backward matmul reads w2.T again
        return jax.numpy.tanh(jax.numpy.tanh(x @ w1.T) @ w2.T).sum()

    w = jax.ShapeDtypeStruct((1024, 1024), jax.numpy.float32)
    x = jax.ShapeDtypeStruct((8, 1024), jax.numpy.float32)
    prog = trace(jax.grad(loss, argnums=(0, 1)), w, w, x)
    ts = [n.outputs[0] for n in prog.nodes if n.primitive == "transpose"
          and prog.values[n.inputs[0]].producer is None]
    assert ts and all({prog.nodes[i].primitive for i in prog.users[t]} == {"dot_general"}
                      for t in ts)
    assert not any(materialised(prog, "cuda")[t] for t in ts)
    assert all(materialised(prog, "cuda", fold_dots=False)[t] for t in ts)
    assert all(materialised(prog, "cpu")[t] for t in ts)
    folded = liveness(prog, platform="cuda")[1]
    stored = liveness(prog, platform="cuda", fold_dots=False)[1]
    # w2.T (4 MiB) lives from the forward to the backward matmul that reads it again
    assert max(s - f for s, f in zip(stored, folded, strict=True)) >= 4 * 2**20


#: H100-target steps whose default first compiles miss the compiled best by more than 1%,
#: and by how much at most (%): docs/first_call.md, "A plan the model puts far up joins ...".
#: The zoo MLP at bench size: the cost model and the rewritten liveness both put
#: ``selective(depth=2)`` lowest (80.25 MiB compiled), ``auto(regions=blocks at depth 2)``
#: compiles to 78.91 (+1.7%) since the rewrite's barrier change of 2026-12-05.
#: The zoo UNet at test size, since the liveness model reads the rewrite's barriers
#: (docs/first_call.md, "The rewrite's barriers in the liveness model"): MEDL's plan and
#: its per-block grouping tie in the cost model and are 0.2% apart in the rewritten
#: liveness, which picks ``auto`` (284.5 KiB compiled) where the block grouping compiles
#: to 275.8 (+1.4%).
_H100_MISSES = {("prediction/plans-h100.json", "mlp"): 2.0,
                ("prediction/plans-h100-test.json", "unet"): 2.0}


def test_the_plain_error_bound_covers_every_measured_over_prediction():
    """``verify=True`` keeps a plan without compiling the plain step where it compiled more
    than ``PLAIN_ERROR`` below the plain step's *predicted* peak; that is below the plain
    step's compiled peak only where the model over-predicts it by less than
    ``1 / (1 - PLAIN_ERROR) - 1``. Every plain step measured (the zoo's, and the corpus of
    other people's train steps, bench size, CPU and the H100 target) is within that."""
    from jaxmem.compiling.predicted import PLAIN_ERROR, PLAIN_MIN_BYTES

    platform = {"cpu": "cpu", "h100": "cuda"}
    rows = [r for f in ("prediction/prediction.json", "prediction_corpus/prediction.json")
            for r in json.loads((ROOT / "benchmarks/results" / f).read_text())["rows"]
            if r.get("step") == "plain" and not r.get("error")]
    corpus = [r for r in rows if r["model"].startswith("corpus:")]
    assert len(corpus) >= 20 and len(rows) >= 40
    for r in rows:
        if r["predicted"] >= PLAIN_MIN_BYTES:
            bound = PLAIN_ERROR[platform[r["target"]]]
            assert r["compiled"] > r["predicted"] * (1 - bound), r


#: The ``prediction --plans`` files: every candidate of each step compiled.
_PLANS_FILES = ("prediction/plans-cpu.json", "prediction/plans-h100.json",
                "prediction/plans-cpu-test.json", "prediction/plans-h100-test.json",
                "prediction/plans-cpu-more.json", "prediction_corpus/plans-h100.json",
                "prediction_corpus/plans-h100-jraph.json",
                "prediction_corpus/plans-h100-gpt2.json")


def test_the_rewritten_step_bound_covers_every_measured_plan():
    """The ranked budget search does not compile a block plan whose rewritten step the
    liveness model puts above the budget by more than ``REWRITTEN_OVER``: sound only where
    no plan compiled that far below its rewritten step's prediction. Every candidate plan
    of the ``prediction --plans`` files (zoo and corpus, CPU and the H100 target) and every
    block plan of ``budget_blocks-h100.json`` is within it."""
    from jaxmem.planning.budget.ranked_blocks import REWRITTEN_OVER

    pairs = [(r["rewritten"], r["compiled"], f, r["candidate"]) for f in _PLANS_FILES
             for m in json.loads((ROOT / "benchmarks/results" / f).read_text())["models"]
             for r in m["candidates"]
             if r["kind"] == "plan" and r.get("rewritten") and r.get("compiled")]
    blocks = json.loads((ROOT / "benchmarks/results/budget_blocks-h100.json").read_text())
    pairs += [(r["rewritten"], r["compiled"], name, r["program"])
              for name, rows in blocks["models"].items() for r in rows if "rewritten" in r]
    assert len(pairs) >= 240
    for rewritten, compiled, *where in pairs:
        assert rewritten <= REWRITTEN_OVER * compiled, where


def test_the_candidates_left_out_never_compiled_near_the_lowest():
    """``auto_candidates`` no longer lists MEDL's strict variant nor per-block
    ``dots_saveable`` on the unjoined cut: over the ``prediction --plans`` files (every
    candidate compiled) neither kind ever compiled within 1% of its step's lowest plan
    (``ranking_union --kinds``), ``verify=True``'s first compiles land as far above the
    lowest on every step without them (``ranking_union --drop``), and today's list holds
    neither."""
    from benchmarks import ranking_union
    from jaxmem.analyzing.analysis import from_program
    from jaxmem.planning.strategies import auto_candidates

    left_out = ("auto (strict: 5% per layer)", "heavy kept, light unjoined")
    files = [str(ROOT / "benchmarks/results" / f) for f in _PLANS_FILES]
    kinds = ranking_union.kinds(files)
    gone = {k: v for k, v in kinds.items() if any(d in k for d in left_out)}
    assert len(gone) == 2 and sum(n for n, _, _ in gone.values()) >= 29, gone
    assert all(near == 0 for _, _, near in gone.values()), gone
    for f in files:
        before = [r[3]["all"]["over"] for r in ranking_union.step_rows(f)]
        assert [r[3]["all"]["over"] for r in ranking_union.step_rows(f, left_out)] == before
    w = zoo.make("transformer", size="test")
    names = [p.strategy for p in auto_candidates(from_program(jaxmem.trace(w.step, *w.args)))]
    assert not any(k in n for n in names for k in left_out), names


def test_ranking_union_reads_the_plans_files():
    """``benchmarks.ranking_union`` over the committed ``prediction --plans`` files: the
    union of the cost model's three and the rewritten step's first never lands above either
    set alone, and held the compiled best on every step there, to within what the ranking
    counts as a tie (``TIE``, 1%: transformers' ResNet18's two selective plans compile
    0.1% apart; what ``verify="builtins"`` relies on since ``with_rewritten_best``); what
    ``verify=True`` compiles first since issue 37 (``default``) is a subset of it, and on
    every H100-target step holds a plan within 1% of every compiled candidate, built-ins
    and plain included, but the misses docs/first_call.md lists with their cause
    (``_H100_MISSES``: no more than that)."""
    from benchmarks import ranking_union
    from benchmarks.prediction_plans import TIE

    files = ("prediction/plans-cpu.json", "prediction/plans-h100.json",
             "prediction/plans-cpu-test.json", "prediction/plans-h100-test.json",
             "prediction_corpus/plans-h100.json", "prediction_corpus/plans-h100-jraph.json",
             "prediction_corpus/plans-h100-gpt2.json")
    rows = [(f, *r) for f in files
            for r in ranking_union.step_rows(str(ROOT / "benchmarks/results" / f))]
    assert len(rows) >= 9
    for f, model, target, _, sets in rows:
        union = sets["union"]["over"]
        assert union is not None and union <= min(
            x["over"] for x in (sets["model3"], sets["rewritten1"]) if x["over"] is not None)
        assert union <= 100 * TIE, (f, model, sets)
        assert 1 <= sets["default"]["n"] <= sets["union"]["n"] + 1
        if target == "h100":
            assert sets["all"]["over"] <= _H100_MISSES.get((f, model), 1.0), (f, model, sets)
    # CROWD: the cost model's choice, ranked out by the crowd's rewritten steps, is not
    # compiled first on the two conv steps where it compiled 8.7% and 4.7% above the best
    crowded = {model: sets["default"]["n"] for f, model, _, _, sets in rows
               if f == "prediction_corpus/plans-h100.json"}
    assert crowded["corpus:tx_resnet18_ts"] == crowded["corpus:hk_resnet50"] == 1, crowded


def test_gpu_max_pooling_computes_its_input_in_its_kernels():
    """XLA:GPU computes a value read by max-pooling alone (its forward reduce-window and its
    gradient) inside those kernels, from the value's own inputs: a ReLU of a convolution's
    output before a pool is not stored on the H100 target; XLA:CPU stores it, and a value
    read by elementwise code as well is stored on both."""
    from jax import lax
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import materialised

    assert fusion.pooled_in_kernel(("reduce_window_max", "select_and_scatter_add"), "cuda")
    assert not fusion.pooled_in_kernel(("reduce_window_max", "select_and_scatter_add"), "cpu")
    assert not fusion.pooled_in_kernel(("reduce_window_max", "mul"), "cuda")
    assert not fusion.pooled_in_kernel((), "cuda")

    def pool(y):
        return lax.reduce_window(y, -jax.numpy.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                 "SAME")

    def loss(k, x, also):
        h = lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        r = jax.nn.relu(h)
        return (pool(r) ** 2).sum() + ((r * r).sum() if also else 0.0)

    k = jax.ShapeDtypeStruct((3, 3, 4, 8), jax.numpy.float32)
    x = jax.ShapeDtypeStruct((2, 8, 8, 4), jax.numpy.float32)
    for also, stored_on_gpu in ((False, False), (True, True)):
        prog = trace(jax.grad(lambda k, x, a=also: loss(k, x, a)), k, x)
        pooled = [v for n in prog.nodes if n.primitive == "reduce_window_max"
                  for v in n.inputs]
        (relu,) = {v for v in pooled if prog.values[v].producer is not None}
        readers = {prog.nodes[i].primitive for i in prog.users[relu]}
        assert readers >= {"reduce_window_max", "select_and_scatter_add"}
        assert materialised(prog, "cuda")[relu] is stored_on_gpu, readers
        assert materialised(prog, "cpu")[relu]


def test_gpu_convolution_kernel_layout_copies_are_predicted(h100):
    """XLA:GPU runs convolutions through cuDNN with the kernel output-features major and
    input-features minor (``o01i``): a kernel argument stored HWIO (flax, haiku, keras) is
    copied into that layout for the forward convolution, the input gradient's and the
    update, one OHWI is read as it is. The liveness model adds the copy on the H100 target
    and not on CPU: the predicted peaks differ by what the compiled ones differ by, the
    kernel's bytes."""
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import liveness, materialised

    def step_for(rhs):
        dn = ("NHWC", rhs, "NHWC")

        def loss(k, x):
            y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)
            y = jax.lax.conv_general_dilated(jax.numpy.tanh(y), k, (1, 1), "SAME",
                                             dimension_numbers=dn)
            return jax.numpy.sum(jax.numpy.tanh(y))

        return lambda k, x: k - 0.1 * jax.grad(loss)(k, x)

    kernels = {"HWIO": (3, 3, 16, 16), "OHWI": (16, 3, 3, 16)}
    compiled, predicted, on_cpu = {}, {}, {}
    for rhs, shape in kernels.items():
        args = targets.place((jax.ShapeDtypeStruct(shape, jax.numpy.float32),
                              jax.ShapeDtypeStruct((4, 8, 8, 16), jax.numpy.float32)), h100)
        step = step_for(rhs)
        exe = measure.compile(jax.jit(step, donate_argnums=0).lower(*args))
        compiled[rhs] = measure.figures(exe).peak
        prog = trace(step, *args)
        predicted[rhs] = liveness(prog, donated=(0,), platform="cuda")[0]
        on_cpu[rhs] = liveness(prog, donated=(0,), platform="cpu")[0]
    kernel = 4 * 3 * 3 * 16 * 16
    assert compiled["HWIO"] - compiled["OHWI"] == kernel
    assert predicted["HWIO"] - predicted["OHWI"] == kernel
    assert on_cpu["HWIO"] == on_cpu["OHWI"]
    # the input gradient's reversed kernel is folded into cuDNN's backward-input
    # convolution on XLA:GPU (fusion.folds_into_conv), stored on XLA:CPU
    (rev,) = [n.outputs[0] for n in prog.nodes if n.primitive == "rev"]
    assert not materialised(prog, "cuda")[rev] and materialised(prog, "cpu")[rev]
    assert fusion.conv_operand_copies(
        {"dimension_numbers": jax.lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1),
                                                           (0, 3, 1, 2))}, "cuda") == (False, True)


def test_gpu_max_pooling_gradient_expansion_is_predicted(h100):
    """XLA:GPU expands max-pooling's gradient into a window argmax (a variadic
    reduce-window: the maximum and one s32 index per dimension, of the pooled shape) and a
    scatter: into the result's own buffer where no window starts before the operand, else
    into a zeroed copy of the padded operand, sliced out after the indices are dead. The
    liveness model gives the compiled peak of both to within the tuples' pointers: the
    result a buffer of its own (no low padding), and read by the update of a donated input
    (low padding, as a train step's gradient is)."""
    from jax import lax
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import liveness

    shape = (8, 32, 32, 16)
    for pad, donate in ((((0, 0), (0, 1), (0, 1), (0, 0)), ()),
                        (((0, 0), (1, 1), (1, 1), (0, 0)), (0,))):
        def pool(x, pad=pad):
            return lax.reduce_window(x, -jax.numpy.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                     pad)

        def f(x, ct, pool=pool):
            return 2.0 * jax.vjp(pool, x)[1](ct)[0]

        out = jax.eval_shape(pool, jax.ShapeDtypeStruct(shape, jax.numpy.float32))
        args = targets.place((jax.ShapeDtypeStruct(shape, jax.numpy.float32),
                              jax.ShapeDtypeStruct(out.shape, jax.numpy.float32)), h100)
        exe = measure.compile(jax.jit(f, donate_argnums=donate).lower(*args))
        compiled = measure.figures(exe).peak
        predicted = liveness(trace(f, *args), donated=donate, platform="cuda")[0]
        assert 0 <= compiled - predicted <= 64, (pad, compiled, predicted)


def test_temporaries_are_aligned_as_xla_places_them():
    """XLA places each temporary at an aligned offset of its temp allocation (XLA:GPU 256
    bytes, XLA:CPU 64; read from the buffer assignment's offsets)."""
    assert [fusion.aligned_bytes(n, "cuda") for n in (1, 256, 257)] == [256, 256, 512]
    assert [fusion.aligned_bytes(n, "cpu") for n in (36, 64, 100)] == [64, 64, 128]
    assert fusion.aligned_bytes(100, "tpu") == 100


def test_gpu_split_k_pads_and_partials_are_predicted_exactly(h100):
    """XLA:GPU splits the contraction of a matmul whose output has too few tiles for the
    device (``SplitkRewriter``): ``[64, 5001] @ [5001, 64]`` is split 32 ways, both operands
    padded to 5120 (the ``tanh`` of the left one is computed in the pad, never stored) and
    f32 partial products summed; the liveness model gives the H100 target's compiled peak
    to within the scalar output's 4 bytes. On CPU nothing is split."""
    from jaxmem.program import trace

    from jaxmem.analyzing.liveness import liveness

    assert fusion.split_k(1, 64, 64, 5001, 32, 32, 32, "cuda") == 32
    assert fusion.split_k(1, 64, 64, 5001, 32, 32, 32, "cpu") == 1
    assert fusion.split_k_bytes(1, 64, 64, 5001, 32, 32, 32, "cuda") == (
        4 * 5120 * (64 + 64), 4 * 32 * 64 * 64)

    def f(g, w):
        return jax.numpy.sum(jax.numpy.tanh(g) @ w)

    args = targets.place((jax.ShapeDtypeStruct((64, 5001), jax.numpy.float32),
                          jax.ShapeDtypeStruct((5001, 64), jax.numpy.float32)), h100)
    compiled = measure.figures(measure.compile(jax.jit(f).lower(*args))).peak
    prog = trace(f, *args)
    predicted = liveness(prog, platform="cuda")[0]
    assert abs(predicted - compiled) <= 8
    # without the rule: the tanh stored, no pads or partials
    assert liveness(prog, platform="cpu")[0] < 0.8 * compiled
