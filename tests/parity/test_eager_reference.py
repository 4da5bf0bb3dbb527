"""The reference runs eagerly whatever TorchDynamo state an implementation leaves in the worker
(:func:`parity.engine.eager`). Reached from a frame Dynamo evaluates (here: a ``torch.compile``\\'d caller, standing in
for a callback an implementation's compiled code left installed), the reference's checkpointed row blocks fail with
``CheckpointError`` — the negative control — while :func:`parity.engine.reference_runs` (guarded) returns the same
values as a plain call. ~10 s on 2 cores (two small aot_eager compiles)."""

from __future__ import annotations

import pytest
import torch

from cases.tensors import materialize
from parity import impls
from parity.engine import reference_runs
from parity.judge.snapshot import take_snapshot
from tests.parity.helpers import pick

REF = impls.load("reference")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the negative control lets Dynamo trace the reference, which then warns of each cached helper it traces through
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function")
def test_the_reference_runs_eagerly_under_a_dynamo_callback():
    case = pick(dtype="float32", layout="bshd", ratio="4", training=True)
    tensors = materialize(case, "cpu")
    plain, _, _ = reference_runs(case, REF, tensors, None, None, case.dtype)
    guarded = torch.compile(lambda: reference_runs(case, REF, tensors, None, None, case.dtype)[0],
                            backend="aot_eager")()
    assert set(guarded.tensors) == set(plain.tensors)
    for name, value in plain.tensors.items():
        if value is not None:
            assert torch.equal(guarded[name], value), name
    # negative control: the same reference call, unguarded, from a frame Dynamo evaluates
    with pytest.raises(Exception, match="checkpoint"):
        torch.compile(lambda: take_snapshot(REF.api, case, tensors, upcast=True), backend="aot_eager")()
