"""An error raised inside a C++ backward node is reported at the frame of the code under test that built the node
(:mod:`parity.backward_origin`), not at the harness's backward call; an error whose traceback already names that code
is reported as before, with no re-run."""

import torch

from parity import backward_origin, impls
from parity.engine import RunOptions, run_case
from tests.parity.helpers import pick

REF = impls.load("reference")


def run(impl_name, case):
    return run_case(case, impls.load(impl_name), REF, RunOptions(impl=impl_name, device="cpu"))


def test_a_cpp_backward_error_names_the_forward_call_that_built_the_node():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run("tests.parity.fakes:reference_backward_raises", case)
    assert result.outcome == "error", result.message
    assert "modified by an inplace operation" in result.message
    where = result.message[result.message.rindex(" [") + 1:]
    assert where.startswith("[parity/fakes.py:_gather_term:"), where
    assert "(GatherBackward0), in its backward; raised under judge/snapshot.py:take_snapshot:" in where


def test_an_error_of_python_backward_code_keeps_its_own_frame_and_is_not_re_run(monkeypatch):
    """Negative control: the traceback already names the code under test; the locator is not called."""
    calls = []
    monkeypatch.setattr(backward_origin, "locate", lambda *a, **k: calls.append(1) or "never")
    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run("tests.parity.fakes:reference_python_backward_raises", case)
    assert result.outcome == "error" and "planted failure in a Python backward" in result.message
    assert "[parity/fakes.py:backward:" in result.message and "in its backward" not in result.message
    assert calls == []


def test_a_forward_error_is_not_a_backward_error():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run("tests.parity.fakes:fused_raises", case)
    assert result.outcome == "error" and "in its backward" not in result.message


def _backward_error(message: str) -> BaseException:
    x = torch.ones(3, requires_grad=True)
    index = torch.zeros(3, dtype=torch.long)
    y = torch.gather(x, 0, index)
    index.add_(0)
    try:
        torch.autograd.grad(y.sum(), [x])
    except RuntimeError as exc:
        return exc if not message else RuntimeError(message).with_traceback(exc.__traceback__)
    raise AssertionError("the planted backward error did not happen")


def test_which_errors_are_located():
    assert backward_origin.raised_in_backward_without_frame(_backward_error(""))
    # negative controls: out of memory (a re-run would only run out again), and an error raised outside a backward
    assert not backward_origin.raised_in_backward_without_frame(_backward_error("CUDA out of memory. Tried to ..."))
    try:
        torch.zeros(2).view(3)
    except RuntimeError as exc:
        assert not backward_origin.raised_in_backward_without_frame(exc)


def test_the_innermost_frame_outside_torch_is_the_call_site():
    stack = ['  File "/x/parity/judge/snapshot.py", line 140, in take_snapshot\n    result = _call(...)\n',
             '  File "/m/megatron/core/transformer/experimental_attention_variant/csa.py", line 687, in '
             'unfused_compressed_sparse_attn\n    kv_gathered = torch.gather(\n',
             '  File "/v/lib/python3.12/site-packages/torch/overrides.py", line 1, in handle\n    pass\n']
    assert backward_origin.innermost_own_frame(stack) == \
        "experimental_attention_variant/csa.py:unfused_compressed_sparse_attn:687"
    assert backward_origin.innermost_own_frame(stack[2:]) is None
