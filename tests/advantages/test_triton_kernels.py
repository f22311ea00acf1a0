"""The fused Triton scans (advantages/triton_kernels.py) against the serial references (reference_returns.py).

No GPU in CI: the kernels run on CPU tensors under Triton's interpreter. ``TRITON_INTERPRET=1``
must be set before ``triton`` is imported, so one subprocess (this file run as a script) computes
every case and saves inputs and outputs; the tests here compare them with the reference. The
same kernels are also compiled for an H100/H200 (sm_90) in-process, which catches what the
interpreter does not check (types, layouts, the asynchronous-copy pipeline).
"""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.host_syncs import HostSyncs

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from advantages import triton_kernels  # noqa: E402
from masking.spans import SpanKind  # noqa: E402
from tests.helpers.reference_returns import discounted_returns_ref, gae_ref, whiten_ref  # noqa: E402

A, O, P = int(SpanKind.ASSISTANT), int(SpanKind.OBSERVATION), int(SpanKind.PAD)
BLOCK = 16  # small chunks so short rows cross several chunk boundaries
LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5)
GAMMAS = (0.0, 0.5, 0.99, 1.0)
LAMS = (0.0, 0.95, 1.0)
TOLERANCE = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=2e-2, rtol=1e-2), "float16": dict(atol=2e-3, rtol=2e-3)}


# --- inputs ---

def agent_spans(t, generator):
    """Rows like a multi-turn agent's: alternating ASSISTANT/OBSERVATION spans, trailing PAD,
    plus an all-PAD row, an all-ASSISTANT row and a row that starts with an observation."""
    rows = []
    for length in (t, max(t - 3, 0), t // 2, 0, t, t):
        row, kind = [], A
        while len(row) < length:
            row += [kind] * int(torch.randint(1, 7, (), generator=generator))
            kind = O if kind == A else A
        rows.append(row[:length] + [P] * (t - length))
    rows[4] = [A] * t
    rows[5] = [O] + [A] * (t - 1)
    return torch.tensor(rows, dtype=torch.int8).reshape(len(rows), t)


def cases():
    """Every (name, kernel, inputs, scalars) the interpreter subprocess runs: each length with every
    gamma in float32 and bfloat16 (lambda 0.95), and lambda 0 and 1 and float16 at gamma 0.99."""
    generator = torch.Generator().manual_seed(7)
    for t in LENGTHS:
        spans = agent_spans(t, generator)
        rewards = torch.randn(spans.shape, generator=generator)
        values = torch.randn(spans.shape, generator=generator)
        grid = [(dtype, gamma, 0.95) for dtype in ("float32", "bfloat16") for gamma in GAMMAS]
        grid += [("float32", 0.99, lam) for lam in LAMS if lam != 0.95] + [("float16", 0.99, 0.95)]
        for dtype, gamma, lam in grid:
            r, v = rewards.to(getattr(torch, dtype)), values.to(getattr(torch, dtype))
            if lam == 0.95:
                yield f"returns-t{t}-{dtype}-g{gamma}", "returns", dict(rewards=r, spans=spans), dict(gamma=gamma)
            yield f"gae-t{t}-{dtype}-g{gamma}-l{lam}", "gae", dict(rewards=r, values=v, spans=spans), dict(gamma=gamma, lam=lam)
    # PAD in the middle of a row resets (the kernel's documented semantics; validation rejects it upstream)
    iid = torch.randint(0, 3, (4, 2 * BLOCK + 3), generator=generator, dtype=torch.int8)
    rewards, values = torch.randn(iid.shape, generator=generator), torch.randn(iid.shape, generator=generator)
    yield "returns-iid-spans", "returns", dict(rewards=rewards, spans=iid), dict(gamma=0.9)
    yield "gae-iid-spans", "gae", dict(rewards=rewards, values=values, spans=iid), dict(gamma=0.9, lam=0.8)


def run_kernels(path):
    """Subprocess side: run every case under the interpreter and save inputs and outputs."""
    results = {}
    for name, kernel, tensors, scalars in cases():
        if kernel == "returns":
            out = (triton_kernels.triton_discounted_returns(**tensors, **scalars, block=BLOCK),)
        else:
            out = triton_kernels.triton_gae(**tensors, **scalars, block=BLOCK)
        results[name] = dict(kernel=kernel, tensors=tensors, scalars=scalars, out=out)
    # the default launch config (one chunk of next_power_of_2(t)) on a row that is not a power of two
    spans = agent_spans(300, torch.Generator().manual_seed(3))
    rewards = torch.randn(spans.shape, generator=torch.Generator().manual_seed(4))
    out = (triton_kernels.triton_discounted_returns(rewards, spans, 0.97),)
    results["returns-default-config"] = dict(kernel="returns", tensors=dict(rewards=rewards, spans=spans), scalars=dict(gamma=0.97), out=out)
    for name, tensors in moment_cases():
        results[name] = triton_kernels.triton_discounted_returns_with_moments(**tensors, gamma=0.99, block=BLOCK)
        results[f"split-{name}"] = triton_kernels.triton_discounted_returns_with_moments(**tensors, gamma=0.99, block=BLOCK, split=True)
        gae_tensors = dict(tensors, values=tensors["rewards"].flip(-1))
        results[f"gae-{name}"] = triton_kernels.triton_gae_with_moments(**gae_tensors, gamma=0.99, lam=0.95, block=BLOCK)
        results[f"split-gae-{name}"] = triton_kernels.triton_gae_with_moments(**gae_tensors, gamma=0.99, lam=0.95, block=BLOCK, split=True)
    for name, kernel, tensors, scalars in split_cases():
        if kernel == "returns":
            out = (triton_kernels.triton_discounted_returns(**tensors, **scalars, block=BLOCK, split=True),)
        else:
            out = triton_kernels.triton_gae(**tensors, **scalars, block=BLOCK, split=True)
        results[name] = dict(kernel=kernel, tensors=tensors, scalars=scalars, out=out)
    # chosen automatically: one row of 4 * SPLIT_BLOCK tokens (fewer rows than SMs)
    spans = agent_spans(4 * triton_kernels.SPLIT_BLOCK, torch.Generator().manual_seed(5))[:1]
    rewards = torch.randn(spans.shape, generator=torch.Generator().manual_seed(6))
    out = (triton_kernels.triton_discounted_returns(rewards, spans, 0.999),)
    unsplit = triton_kernels.triton_discounted_returns(rewards, spans, 0.999, block=triton_kernels.SPLIT_BLOCK, split=False)
    results["estimators"] = run_estimators()
    results["whiten"] = run_whiten()
    results["split-auto"] = dict(kernel="returns", tensors=dict(rewards=rewards, spans=spans), scalars=dict(gamma=0.999), out=out, unsplit=unsplit)
    torch.save(results, path)


def run_estimators():
    """The estimators' CUDA path (Triton kernels, fused moments, one elementwise whitening pass) on
    CPU tensors: the dispatch is pointed at the interpreted kernels. Also records host syncs."""
    import advantages.returns as returns_module
    import masking.validate

    returns_module._triton = lambda x: triton_kernels
    masking.validate.native_check = lambda *tensors: None  # CUDA tensors never take the compiled CPU checks
    generator = torch.Generator().manual_seed(23)
    spans = agent_spans(3 * BLOCK + 5, generator)
    rewards = torch.randn(spans.shape, generator=generator) * (spans == A)
    values = torch.randn(spans.shape, generator=generator)
    mask = (spans == A).float()
    out = dict(spans=spans, rewards=rewards, values=values)
    for validate in (True, False):
        with HostSyncs() as syncs:
            out[f"rpp-{validate}"] = returns_module.whitened_discounted_returns(rewards, mask, 0.99, spans=spans, validate=validate)
            out[f"gae-{validate}"] = returns_module.gae(rewards, values, mask, 0.99, 0.95, spans=spans, validate=validate)
        out[f"syncs-{validate}"] = syncs.seen
    out["rpp-mask-only"] = returns_module.whitened_discounted_returns(rewards, mask, 0.99)
    for tokens in (0, 1, 2):  # issue 28: unvalidated batches with fewer than 2 ASSISTANT tokens
        few = torch.full((3, 6), O, dtype=torch.int8)
        few[2, 3:] = P
        few.view(-1)[[4, 7][:tokens]] = A
        few_rewards = torch.where(few == A, torch.tensor([1.5]), 0.0)
        few_values = torch.linspace(-1, 1, 18).reshape(3, 6)
        few_mask = (few == A).float()
        out[f"few-{tokens}"] = dict(
            spans=few, rewards=few_rewards, values=few_values,
            rpp=returns_module.whitened_discounted_returns(few_rewards, few_mask, 0.9, spans=few, validate=False),
            gae=returns_module.gae(few_rewards, few_values, few_mask, 0.9, 0.95, spans=few, validate=False),
        )
    return out


def row_moments(values, spans):
    """Per-row (count, mean, M2) float32 of ``values`` on ASSISTANT tokens, in float64 torch ops."""
    keep = (spans == A).double()
    count = keep.sum(1)
    mean = (values.double() * keep).sum(1) / count.clamp(min=1)
    m2 = (((values.double() - mean[:, None]) * keep) ** 2).sum(1)
    return torch.stack([count, mean, m2], 1).float()


def run_whiten():
    """triton_whiten alone: more rows than the stats kernel merges at a time (three blocks), values
    whose mean dwarfs their spread, bfloat16, and batches with 1 and with 0 ASSISTANT tokens."""
    generator = torch.Generator().manual_seed(29)
    spans = torch.randint(0, 3, (2 * triton_kernels.STATS_ROWS + 50, 5), generator=generator, dtype=torch.int8)
    values = 100.0 + torch.randn(spans.shape, generator=generator)
    one = torch.full_like(spans, O)
    one[7, 3] = A
    out = dict(spans=spans, values=values)
    for name, s in (("many-rows", spans), ("one-token", one), ("no-token", torch.full_like(spans, O))):
        out[name] = triton_kernels.triton_whiten(values, s, row_moments(values, s), 1e-8)
    half = values.bfloat16()
    out["bfloat16"] = triton_kernels.triton_whiten(half, spans, row_moments(half, spans), 1e-8)
    return out


def split_cases():
    """Rows split across programs (chunks of BLOCK): a row of one chunk, chunk boundaries, 19 chunks
    (the carry scan over a padded power of two), PAD inside rows, every gamma, bfloat16."""
    generator = torch.Generator().manual_seed(17)
    for t in (BLOCK - 3, 2 * BLOCK, 19 * BLOCK - 5):
        spans = agent_spans(t, generator)
        rewards = torch.randn(spans.shape, generator=generator)
        values = torch.randn(spans.shape, generator=generator)
        for gamma in GAMMAS:
            yield f"split-t{t}-float32-g{gamma}", "returns", dict(rewards=rewards, spans=spans), dict(gamma=gamma)
            gae_inputs = dict(rewards=rewards, values=values, spans=spans)
            yield f"split-gae-t{t}-float32-g{gamma}", "gae", gae_inputs, dict(gamma=gamma, lam=0.95)
        yield f"split-t{t}-bfloat16-g0.99", "returns", dict(rewards=rewards.bfloat16(), spans=spans), dict(gamma=0.99)
        half = dict(rewards=rewards.bfloat16(), values=values.bfloat16(), spans=spans)
        yield f"split-gae-t{t}-bfloat16-l0", "gae", half, dict(gamma=0.99, lam=0.0)
    iid = torch.randint(0, 3, (3, 5 * BLOCK + 1), generator=generator, dtype=torch.int8)
    iid_rewards, iid_values = torch.randn(iid.shape, generator=generator), torch.randn(iid.shape, generator=generator)
    yield "split-iid-spans", "returns", dict(rewards=iid_rewards, spans=iid), dict(gamma=0.9)
    yield "split-gae-iid-spans", "gae", dict(rewards=iid_rewards, values=iid_values, spans=iid), dict(gamma=0.9, lam=0.8)


def moment_cases():
    generator = torch.Generator().manual_seed(11)
    for t in (BLOCK + 1, 3 * BLOCK + 5):
        spans = agent_spans(t, generator)
        rewards = 5.0 + torch.randn(spans.shape, generator=generator)  # a mean far from 0: no cancellation allowed
        for dtype in ("float32", "bfloat16"):
            yield f"moments-t{t}-{dtype}", dict(rewards=rewards.to(getattr(torch, dtype)), spans=spans)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # its parent: tests.helpers
    paths = os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=paths)
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


CASE_NAMES = [name for name, *_ in cases()] + ["returns-default-config", "split-auto"] + [name for name, *_ in split_cases()]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_matches_serial_reference(interpreted, name):
    case = interpreted[name]
    tensors, scalars, out = case["tensors"], case["scalars"], case["out"]
    spans = tensors["spans"]
    if case["kernel"] == "returns":
        expected = (discounted_returns_ref(tensors["rewards"], spans, **scalars),)
    else:
        expected = gae_ref(tensors["rewards"], tensors["values"], spans, **scalars)
    dtype = str(tensors["rewards"].dtype).removeprefix("torch.")
    for got, want in zip(out, expected, strict=True):
        assert got.dtype == tensors["rewards"].dtype and got.shape == spans.shape
        tolerance = dict(TOLERANCE[dtype])
        tolerance["atol"] *= max(1.0, float(want.abs().max()))  # float32 sums of long rows: relative to their size
        torch.testing.assert_close(got.double(), want, **tolerance)
        assert torch.all(got[spans != A] == 0), "non-ASSISTANT positions must be exactly 0"
    if "unsplit" in case:  # the split picked automatically gives the one-program-per-row result exactly
        assert torch.equal(out[0], case["unsplit"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["", "split-", "gae-", "split-gae-"])
@pytest.mark.parametrize("name", [name for name, _ in moment_cases()])
def test_fused_moments_match_the_returns(interpreted, name, kind):
    """Per-row count/mean/M2 of the ASSISTANT returns (GAE: advantages), and their merge into the
    batch's Bessel variance; rows split across programs merge their chunks' moments."""
    tensors = dict(moment_cases())[name]
    spans = tensors["spans"]
    if kind.endswith("gae-"):
        returns, gae_returns, moments = interpreted[kind + name]
        expected, expected_gae_returns = gae_ref(tensors["rewards"], tensors["rewards"].flip(-1), spans, 0.99, 0.95)
        torch.testing.assert_close(gae_returns.double(), expected_gae_returns, **TOLERANCE[name.rsplit("-", 1)[1]])
    else:
        returns, moments = interpreted[kind + name]
        expected = discounted_returns_ref(tensors["rewards"], spans, 0.99)
    torch.testing.assert_close(returns.double(), expected, **TOLERANCE[name.rsplit("-", 1)[1]])
    assistant = spans == A
    for row in range(spans.shape[0]):
        row_returns = expected[row][assistant[row]]
        count = len(row_returns)
        mean = row_returns.mean() if count else torch.tensor(0.0, dtype=torch.float64)
        want = torch.stack([torch.tensor(float(count), dtype=torch.float64), mean, ((row_returns - mean) ** 2).sum()])
        torch.testing.assert_close(moments[row].double(), want, atol=1e-3, rtol=1e-4)
    count, mean, var = triton_kernels.merge_moments(moments)
    assert int(count) == int(assistant.sum())
    torch.testing.assert_close(mean, expected[assistant].mean(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(var, expected[assistant].var(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_estimators_on_the_kernels_whiten_from_fused_moments_without_host_sync(interpreted):
    """whitened_discounted_returns (REINFORCE++) and gae(whiten=True) on the Triton path match the
    serial references; without validation they call nothing that syncs with the host (so the
    estimator can be captured in a CUDA graph: the capture itself needs a GPU, owed)."""
    out = interpreted["estimators"]
    spans, rewards, values = out["spans"], out["rewards"], out["values"]
    expected_returns = discounted_returns_ref(rewards, spans, 0.99)
    expected_gae, expected_gae_returns = gae_ref(rewards, values, spans, 0.99, 0.95)
    for validate in (True, False):
        advantages, returns = out[f"rpp-{validate}"]
        torch.testing.assert_close(returns.double(), expected_returns, **TOLERANCE["float32"])
        torch.testing.assert_close(advantages.double(), whiten_ref(expected_returns, spans), **TOLERANCE["float32"])
        gae_advantages, gae_returns = out[f"gae-{validate}"]
        torch.testing.assert_close(gae_returns.double(), expected_gae_returns, **TOLERANCE["float32"])
        torch.testing.assert_close(gae_advantages.double(), whiten_ref(expected_gae, spans), **TOLERANCE["float32"])
        assert torch.all(advantages[spans != A] == 0) and torch.all(gae_advantages[spans != A] == 0)
    assert out["syncs-False"] == []
    assert out["syncs-True"]  # validation does read its checks back (one sync on CUDA)
    torch.testing.assert_close(out["rpp-mask-only"][0], out["rpp-True"][0])  # PAD trails: the same as with spans


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [0, 1, 2])
def test_estimators_on_the_kernels_with_few_assistant_tokens(interpreted, tokens):
    """Unvalidated, on the Triton path: exactly 0 off the mask always, and 0 everywhere below 2
    ASSISTANT tokens (advantages/stats.py); the returns as the serial reference."""
    case = interpreted["estimators"][f"few-{tokens}"]
    spans, rewards, values = case["spans"], case["rewards"], case["values"]
    expected = {"rpp": (discounted_returns_ref(rewards, spans, 0.9),), "gae": gae_ref(rewards, values, spans, 0.9, 0.95)}
    for kind in ("rpp", "gae"):
        advantages, returns = case[kind]
        torch.testing.assert_close(returns.double(), expected[kind][-1], **TOLERANCE["float32"])
        assert torch.equal(advantages[spans != A], torch.zeros_like(advantages[spans != A]))
        if tokens < 2:
            assert torch.equal(advantages, torch.zeros_like(advantages))
        else:
            torch.testing.assert_close(advantages.double(), whiten_ref(expected[kind][0], spans), **TOLERANCE["float32"])


@pytest.mark.slow
def test_whitening_kernels_merge_many_rows_and_give_zero_below_two_tokens(interpreted):
    """triton_whiten (one program merges the rows' moments in blocks, then one elementwise pass)
    against the serial whitening; exactly 0 everywhere below 2 ASSISTANT tokens, as masked_whiten(check=False)."""
    out = interpreted["whiten"]
    spans, values = out["spans"], out["values"]
    got = out["many-rows"]
    assert got.dtype == torch.float32 and torch.all(got[spans != A] == 0)
    torch.testing.assert_close(got.double(), whiten_ref(values, spans), **TOLERANCE["float32"])
    half = out["bfloat16"]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), whiten_ref(values.bfloat16(), spans), **TOLERANCE["bfloat16"])
    for name in ("one-token", "no-token"):
        assert torch.equal(out[name], torch.zeros_like(values)), name


@pytest.mark.slow
def test_observation_tokens_leave_assistant_returns_unchanged(interpreted):
    """Inserting an observation span between assistant tokens changes nothing on the assistant tokens."""
    case = interpreted[f"returns-t{LENGTHS[-1]}-float32-g0.99"]
    spans, rewards = case["tensors"]["spans"], case["tensors"]["rewards"]
    row = 0
    assistant = spans[row] == A
    squeezed = discounted_returns_ref(rewards[row][assistant][None], torch.full((1, int(assistant.sum())), A, dtype=torch.int8), 0.99)
    torch.testing.assert_close(case["out"][0][row][assistant].double(), squeezed[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_worked_example_of_the_design(tmp_path):
    """docs/design.md section 3: gamma 0.5, spans [A, A, O, O, A, P, P], reward 2 at t=4."""
    script = (
        "import torch; from advantages.triton_kernels import triton_discounted_returns as f;"
        "r = torch.tensor([[0, 0, 0, 0, 2.0, 0, 0]]); s = torch.tensor([[1, 1, 2, 2, 1, 0, 0]], dtype=torch.int8);"
        "print(f(r, s, 0.5, block=16).tolist())"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([[0.5, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])


def test_bad_inputs_raise_clear_errors():
    spans = torch.ones(2, 5, dtype=torch.int8)
    with pytest.raises(ValueError, match="spans must be a .* int8"):
        triton_kernels.triton_discounted_returns(torch.zeros(2, 5), spans.long(), 0.9)
    with pytest.raises(ValueError, match="rewards has shape"):
        triton_kernels.triton_discounted_returns(torch.zeros(2, 4), spans, 0.9)
    with pytest.raises(ValueError, match="values must be float32"):
        triton_kernels.triton_gae(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.float64), spans, 0.9, 0.95)
    with pytest.raises(ValueError, match="power of two"):
        triton_kernels.launch_config(5, block=48)
    if not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="need CUDA tensors"):
            triton_kernels.triton_gae(torch.zeros(2, 5), torch.zeros(2, 5), spans, 0.9, 0.95)


def test_dispatch_predicate(monkeypatch):
    monkeypatch.delenv(triton_kernels.DISABLE_ENV, raising=False)
    assert not triton_kernels.triton_available(torch.zeros(1))  # CPU tensors use the torch scan
    cuda_like = SimpleNamespace(is_cuda=True)  # only .is_cuda is read; no GPU here
    assert triton_kernels.triton_available(cuda_like)
    monkeypatch.setenv(triton_kernels.DISABLE_ENV, "1")
    assert not triton_kernels.triton_available(cuda_like)


def test_default_launch_config():
    assert triton_kernels.launch_config(1) == (16, 4, triton_kernels.DEFAULT_NUM_STAGES)
    assert triton_kernels.launch_config(300)[0] == 512
    assert triton_kernels.launch_config(16384)[:2] == (triton_kernels.MAX_BLOCK, 8)
    assert triton_kernels.launch_config(16384, block=64, num_warps=2, num_stages=4) == (64, 2, 4)


KERNELS = {  # name, pointer arguments, constexprs other than BLOCK/NUM_STAGES/span kinds
    "returns": ("_discounted_returns_kernel", ("rewards_ptr", "spans_ptr", "out_ptr", "moments_ptr"), {"MOMENTS": False}),
    "returns+moments": ("_discounted_returns_kernel", ("rewards_ptr", "spans_ptr", "out_ptr", "moments_ptr"), {"MOMENTS": True}),
    "gae": ("_gae_kernel", ("rewards_ptr", "values_ptr", "spans_ptr", "adv_ptr", "ret_ptr", "moments_ptr"), {"MOMENTS": False}),
    "gae+moments": ("_gae_kernel", ("rewards_ptr", "values_ptr", "spans_ptr", "adv_ptr", "ret_ptr", "moments_ptr"), {"MOMENTS": True}),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernels_compile_for_hopper(kernel, dtype):
    """Compile to sm_90 code without a GPU, specialised as the JIT does for 16-aligned pointers and
    a row length divisible by 16. Every load must then be an asynchronous copy (the next chunk is
    prefetched while this one is scanned) and every per-token store a 16-byte vector store."""
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the interpreter is on in this process; compiling needs the real JIT")
    name, pointer_names, extra = KERNELS[kernel]
    pointer_type = {"spans_ptr": "*i8", "moments_ptr": "*fp32"}
    pointers = {arg: pointer_type.get(arg, f"*{dtype}") for arg in pointer_names}
    scalars = {"t": "i32", "gamma": "fp32"} | ({"lam": "fp32"} if kernel.startswith("gae") else {})
    constexprs = {"BLOCK": 2048, "NUM_STAGES": 2, "ASSISTANT": A, "OBSERVATION": O} | extra
    signature = pointers | scalars | {arg: "constexpr" for arg in constexprs}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers) + 1)}  # the pointers and t
    source = ASTSource(getattr(triton_kernels, name), signature, constexprs=constexprs, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert "cp.async.c" in ptx and "ld.global" not in ptx
    stores = set(re.findall(r"st\.global\S*", ptx))
    assert stores == ({"st.global.v4.b32", "st.global.b32"} if extra.get("MOMENTS") else {"st.global.v4.b32"})


@pytest.mark.parametrize("moments", [False, True])
def test_split_kernels_compile_for_hopper(moments):
    """The two passes of a split row (returns and GAE) compile to sm_90 code with 16-byte vector stores."""
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the interpreter is on in this process; compiling needs the real JIT")
    kinds = {"ASSISTANT": A, "OBSERVATION": O}
    passes = [
        (triton_kernels._returns_chunk_maps_kernel, ("rewards_ptr", "spans_ptr", "maps_ptr"), {"BLOCK": 2048} | kinds),
        (
            triton_kernels._returns_split_kernel,
            ("rewards_ptr", "spans_ptr", "maps_ptr", "out_ptr", "moments_ptr"),
            {"BLOCK": 2048, "CHUNKS": 128, "MOMENTS": moments} | kinds,
        ),
    ]
    passes += [
        (triton_kernels._gae_chunk_maps_kernel, ("rewards_ptr", "values_ptr", "spans_ptr", "maps_ptr"), {"BLOCK": 2048} | kinds),
        (
            triton_kernels._gae_split_kernel,
            ("rewards_ptr", "values_ptr", "spans_ptr", "maps_ptr", "adv_ptr", "ret_ptr", "moments_ptr"),
            {"BLOCK": 2048, "CHUNKS": 128, "MOMENTS": moments} | kinds,
        ),
    ]
    for kernel, pointer_names, constexprs in passes:
        pointers = {arg: {"spans_ptr": "*i8", "rewards_ptr": "*fp32", "out_ptr": "*fp32"}.get(arg, "*fp32") for arg in pointer_names}
        scalars = {"t": "i32", "gamma": "fp32"} | ({"lam": "fp32"} if "values_ptr" in pointer_names else {})
        signature = pointers | scalars | {arg: "constexpr" for arg in constexprs}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers) + 1)}
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        if "out_ptr" in pointer_names or "adv_ptr" in pointer_names:
            assert "st.global.v4.b32" in ptx


def test_whitening_kernels_compile_for_hopper():
    """The stats kernel (float64 merge) and the elementwise whitening compile to sm_90 code; the
    whitening stores 16 bytes at a time."""
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the interpreter is on in this process; compiling needs the real JIT")
    kernels = [
        (triton_kernels._whitening_stats_kernel, {"moments_ptr": "*fp32", "stats_ptr": "*fp32", "b": "i32", "eps": "fp32"},
         {"ROWS": triton_kernels.STATS_ROWS}),
        (
            triton_kernels._whiten_kernel,
            {"values_ptr": "*fp32", "spans_ptr": "*i8", "out_ptr": "*fp32", "stats_ptr": "*fp32", "size": "i32"},
            {"BLOCK": triton_kernels.WHITEN_BLOCK, "ASSISTANT": A},
        ),
    ]
    ptx = []
    for kernel, arguments, constexprs in kernels:
        signature = arguments | {arg: "constexpr" for arg in constexprs}
        # the pointers and sizes divisible by 16, as the JIT specialises them
        aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(arguments.values()) if kind != "fp32"}
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
        ptx.append(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
    stats, whiten = ptx
    assert "f64" in stats and "st.global" in stats
    assert "st.global.v4.b32" in whiten


# --- the prepared GPU benchmark script (benchmarks/gpu_returns.py): what can be checked without a GPU ---

GPU_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "gpu_returns.py")


def test_gpu_benchmark_refuses_an_existing_out_before_any_work(tmp_path):
    """An earlier run's tables are never overwritten: the script stops before it measures anything."""
    out = tmp_path / "gpu_returns.md"
    out.write_text("an earlier run's tables\n")
    proc = subprocess.run(
        [sys.executable, GPU_SCRIPT, "--interpret-smoke", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and f"--out {out}: exists" in proc.stderr
    assert out.read_text() == "an earlier run's tables\n"


def test_gpu_benchmark_error_is_nan_when_any_output_is():
    """Python's max keeps a NaN only when it comes first: a NaN in a later output must still fail the check."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_returns", GPU_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    small, nan = torch.tensor(1e-7), torch.tensor(float("nan"))
    assert all(script.max_error(errors) != script.max_error(errors) for errors in ([small, nan], [nan, small]))
    assert script.max_error([small, torch.tensor(2e-7)]) == pytest.approx(2e-7)
    assert not script.sweep_ok(torch.float32, script.max_error([small, nan]))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_kernels(sys.argv[1])
