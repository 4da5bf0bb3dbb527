"""``--impl megatron`` against the pinned Megatron-LM snapshot, on CPU: the adapter's own checks, a reduced smoke
subset per provider (every case ``pass`` or a registered ``known``), and every known-deviation entry reproducing on
its recorded cases. The full smoke per provider runs through the CLI (README "Testing Megatron-LM").

Skipped, with the reason, only when no snapshot (and no ``DSV4_MEGATRON``) is available."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.megatron import source

HAVE_MEGATRON = bool(os.environ.get(source.ENV_PATH)) or source.find_snapshot() is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="no Megatron-LM: the pinned snapshot "
                                    "../shared/megatron/megatron-lm-dev-*.tar.gz is absent and DSV4_MEGATRON is unset")
REGISTRY = Path(__file__).resolve().parents[2] / "adapters" / "megatron" / "known_deviations.json"
#: passing cases of the smoke suite covering BSHD/THD x r 0/4/128 x layer/core x train/eval x 3 dtypes
SUBSET = ("c63c8c6d34a6", "9a8dbea368d1", "f48d206efe5b", "140993f2140a", "03836235949d", "2eb1db7b4212",
          "9595c54698e9", "75f2547b5d1e", "63e768a3e6d0", "e0c30660af6f")


# ---- source lookup: clear errors -------------------------------------------------------------------------------------
def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(source.MegatronSourceError, match="does not exist"):
        source.locate(str(tmp_path / "nowhere"))


def test_a_directory_without_megatron_is_a_clear_error(tmp_path):
    with pytest.raises(source.MegatronSourceError, match="not a Megatron-LM checkout"):
        source.locate(str(tmp_path))


def test_a_checkout_without_dsv4_code_is_a_clear_error(tmp_path):
    (tmp_path / "megatron" / "core" / "transformer").mkdir(parents=True)
    with pytest.raises(source.MegatronSourceError, match="has no DSv4 code"):
        source.locate(str(tmp_path))


def test_env_variable_is_checked_like_the_option(tmp_path, monkeypatch):
    monkeypatch.setenv(source.ENV_PATH, str(tmp_path / "nowhere"))
    with pytest.raises(source.MegatronSourceError, match="DSV4_MEGATRON"):
        source.locate()


def _fake_tree(root: Path) -> Path:
    for name in source.REQUIRED_FILES:
        (root / source.VARIANT_DIR).mkdir(parents=True, exist_ok=True)
        (root / source.VARIANT_DIR / name).write_text("")
    return root


def test_the_upstream_revision_of_a_snapshot_a_bundle_checkout_and_a_scratch_copy(tmp_path):
    """What the known-deviation registry's revision ranges are matched against: the snapshot's id; a bundle
    commit's ``Upstream-Commit:`` trailer (not the bundle's own sha); a mutant's scratch copy records the tree it
    was copied from. Negative control: a plain directory has none."""
    import subprocess

    from parity.mutation import megatron_mutants as mutants

    snap = _fake_tree(tmp_path / "megatron-lm-dev-d48bd6be0a" / "megatron-lm-dev-d48bd6be0a")
    located = source.locate(str(snap))
    assert located.revision == "snapshot megatron-lm-dev-d48bd6be0a"
    assert source.upstream_revision(located) == "d48bd6be0a"
    up = "12d3cc03e3fedf8bd6bd4ea2f1a6ead3c0eb8ffc"
    repo = _fake_tree(tmp_path / "bundle")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", f"a commit\n\nUpstream-Commit: {up}"], check=True)
    bundle = source.locate(str(repo))
    assert bundle.revision != up and source.upstream_revision(bundle) == up
    copy = mutants.scratch_copy(repo, tmp_path / "work")
    copied = source.locate(str(copy))
    assert copied.revision == bundle.revision and source.upstream_revision(copied) == up
    plain = source.locate(str(_fake_tree(tmp_path / "plain")))
    assert "not a git work tree" in plain.revision and source.upstream_revision(plain) is None


def test_a_revision_no_api_generation_recognises_is_a_clear_error():
    from adapters.megatron import generations, loader
    from tests.adapters.test_megatron_generations import fake_modules

    needs = [n for n in generations.COMMON + generations.NEWEST.needs if n.name != "fused_qk_topk_naive"]
    src = source.MegatronSource(Path("/x"), "rev", "--megatron")
    with pytest.raises(source.MegatronSourceError, match="can drive: it lacks csa.fused_qk_topk_naive"):
        loader._detect(fake_modules(needs), src)
    assert loader._detect(fake_modules(generations.COMMON + generations.NEWEST.needs), src) is generations.NEWEST


@needs_megatron
def test_snapshot_extraction_is_idempotent(tmp_path):
    archive = source.find_snapshot()
    if archive is None:
        pytest.skip("DSV4_MEGATRON set, no snapshot")
    root = source.extract(archive, into=tmp_path)
    assert (root / source.VARIANT_DIR / "csa.py").is_file()
    assert source.extract(archive, into=tmp_path) == root
    assert [p.name for p in tmp_path.iterdir()] == [source.snapshot_id(archive)]  # no temporary left behind


# ---- runs ------------------------------------------------------------------------------------------------------------
def _run(case_ids, provider):
    from cases.suites import load_suite
    from parity.engine import RunOptions, run_case
    from parity.impls import load

    cases = {c.id: c for c in load_suite("smoke")}
    if not set(case_ids) <= set(cases):  # a registry entry's cases come from smoke, else from nightly
        cases.update({c.id: c for c in load_suite("nightly")})
    impl, ref = load("megatron"), load("reference")
    options = RunOptions(impl="megatron", provider=provider, device="cpu")
    return {cid: run_case(cases[cid], impl, ref, options) for cid in case_ids}


@needs_megatron
@pytest.mark.parametrize("provider", ["unfused", "emulated"])
def test_smoke_subset_passes(provider):
    results = _run(SUBSET, provider)
    bad = {cid: f"{r.outcome}: {r.message}" for cid, r in results.items() if r.outcome != "pass"}
    assert not bad
    layer = next(r for r in results.values() if r.case.scope == "layer" and r.case.config.has_indexer)
    names = {t.name for t in layer.tensors}
    assert {"out", "topk_indices", "index_scores", "indexer_loss", "grad/hidden"} <= names
    lse = [r for r in results.values() if "lse" in {t.name for t in r.tensors}]
    if provider == "emulated":  # production's FlashMLA call returns the LSE; its unfused path has none
        assert len(lse) == len(results)
    else:
        assert not lse and all("lse" in r.not_provided for r in results.values())
    f64 = [r for r in results.values() if r.case.dtype == "float64"]
    assert f64 and all(r.precision == "float32" for r in f64)


def _entries():
    return json.loads(REGISTRY.read_text())["entries"]


#: the providers ``make test`` runs (the cudnn provider needs the GPU)
CPU_PROVIDERS = ("unfused", "emulated")


def _without_evidence(entry, known_ids):
    """Why ``entry`` would escape the reproduction tests below (None: it would not)."""
    if not (set(entry["providers"]) & set(CPU_PROVIDERS) or "*" in entry["providers"]):
        return None  # the GPU provider alone: recorded from an H200 run
    if not entry.get("cases"):
        return "lists a CPU provider but names no case"
    missing = set(entry["cases"]) - known_ids
    return f"cases {sorted(missing)} are in no suite" if missing else None


def test_every_entry_a_cpu_provider_shows_names_the_cases_that_reproduce_it():
    """An entry without cases would never be reproduced by the tests below: a claim, not evidence."""
    from cases.suites import load_suite

    known_ids = {c.id for suite in ("smoke", "nightly", "gate") for c in load_suite(suite)}
    assert {e["id"]: _without_evidence(e, known_ids) for e in _entries()
            if _without_evidence(e, known_ids)} == {}
    # negative controls: an empty or stale case list on a CPU entry is caught; a GPU-only entry is exempt
    cpu = {"providers": ["unfused"], "cases": []}
    assert _without_evidence(cpu, known_ids) == "lists a CPU provider but names no case"
    assert "in no suite" in _without_evidence({**cpu, "cases": ["9f03b4992e07"]}, known_ids)
    assert _without_evidence({"providers": ["cudnn"]}, known_ids) is None


def _any_architecture(entry) -> bool:
    return "*" in entry["architectures"]


@needs_megatron
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_every_registered_deviation_reproduces(provider):
    """Each entry's cases are ``known`` with that entry among the ids that explain them: production matches the
    entry's model (or raises its exception from its frame) at the pinned snapshot. An entry of one architecture
    is reproduced by the test below; entries of other CP sizes: tests/adapters/test_megatron_cp.py."""
    entries = [e for e in _entries() if (provider in e["providers"] or "*" in e["providers"]) and _any_architecture(e)
               and 1 in e.get("cp", [1])]
    ids = sorted({cid for e in entries for cid in e["cases"]})
    results = _run(ids, provider)
    for entry in entries:
        for cid in entry["cases"]:
            r = results[cid]
            assert r.outcome == "known", f"{entry['id']} on {cid}: {r.outcome} {r.message}"
            assert entry["id"] in r.known["id"].split("+"), (entry["id"], cid, r.known)


@needs_megatron
def test_an_architecture_specific_entry_reproduces_where_the_emulated_provider_declares_it():
    """The sm90 entry (fused Path C leaves padding-row dO unmasked) on the emulated provider declaring (9, 0), in a
    fresh process (as the mutants' sm90 preview): known under that entry. Negative control: at the capability the
    emulated provider declares by default (sm100) the architecture does not match and the entry is not named (the
    case fails there too, unregistered: see the entry's evidence). One bf16 gate case of 138 rows: ~30 s each."""
    from adapters.megatron import source as src
    from parity.mutation import megatron_mutants as mutants

    entries = [e for e in _entries() if not _any_architecture(e) and "emulated" in e["providers"]]
    assert entries
    root = src.locate().root
    for entry in entries:
        arch = entry["architectures"][0].removeprefix("sm")
        major, minor = int(arch[:-1]), int(arch[-1])
        jobs = [("emulated", cid, 1) for cid in entry["cases"]]
        for r in mutants.run_child(root, jobs, {"suite": "gate", "device": "cpu",
                                                "stand_in_capability": [major, minor]}):
            assert r["outcome"] == "known" and f"known deviation {entry['id']}" in r["message"], r
    default = mutants.run_child(root, [("emulated", entries[0]["cases"][0], 1)], {"suite": "gate", "device": "cpu",
                                                                               "stand_in_capability": None})
    assert default[0]["outcome"] != "known" and entries[0]["id"] not in default[0]["message"], default


# ---- real-code mutants --------------------------------------------------------------------------------------------
def test_a_patch_that_no_longer_applies_is_reported(tmp_path):
    from parity.mutation import megatron_mutants as mutants

    target = tmp_path / mutants.CSA
    target.parent.mkdir(parents=True)
    target.write_text("nothing to patch here\n")
    with pytest.raises(mutants.PatchError, match="occurs 0 times"):
        mutants.apply(tmp_path, mutants.MUTANTS[2])


def test_patches_go_to_a_scratch_copy_only(tmp_path):
    from parity.mutation import megatron_mutants as mutants

    src = tmp_path / "src"
    (src / mutants.CSA).parent.mkdir(parents=True)
    m = next(m for m in mutants.MUTANTS if m.path == mutants.CSA and m.nth is None)
    (src / mutants.CSA).write_text(f"a\n{m.old}\nb\n")
    copy = mutants.scratch_copy(src, tmp_path / "work")
    mutants.apply(copy, m)
    assert m.new in (copy / mutants.CSA).read_text()
    assert (src / mutants.CSA).read_text() == f"a\n{m.old}\nb\n"


@needs_megatron
def test_every_real_code_mutant_is_killed():
    from adapters.megatron import source as src
    from parity.mutation import megatron_mutants as mutants

    lines = []
    one_rank = [m.name for m in mutants.MUTANTS if m.cp == 1]  # the CP ones: tests/adapters/test_megatron_cp.py
    outcomes = mutants.run_suite(src.locate().root, one_rank, echo=lines.append)
    assert len(outcomes) == len(one_rank) >= 8
    assert [o.name for o in outcomes if o.status != "killed"] == [], "\n".join(lines)
    for o in outcomes:  # killed on every provider that executes the mutant's code
        m = next(m for m in mutants.MUTANTS if m.name == o.name)
        assert set(o.provider.split(",")) == set(m.providers), o


@needs_megatron
def test_promoted_islands_reach_float64_agreement(monkeypatch):
    """DSV4_MEGATRON_PROMOTE=1: a float64 case is judged at float64 level and passes; without it the same case
    carries float32-level error (negative control: the islands are real, and the declaration is what lets it pass)."""
    from adapters.megatron import promote

    case_id = "c63c8c6d34a6"  # float64, layer, BSHD, r = 0
    plain = _run([case_id], "unfused")[case_id]
    monkeypatch.setenv(promote.ENV, "1")
    wide = _run([case_id], "unfused")[case_id]
    assert plain.outcome == "pass" and plain.precision == "float32"
    assert wide.outcome == "pass" and wide.precision is None

    def worst(result):
        return max(m.value for t in result.tensors for m in t.metrics if m.metric == "rel_l2")

    assert worst(wide) < 1e-13 < 1e-9 < worst(plain)


@needs_megatron
def test_a_production_run_adopts_the_workers_it_started_early(tmp_path):
    """``run --impl megatron`` with 2 workers takes both children it started before torch loaded: Megatron's modules
    import ``torch._dynamo``, which would give the parent torch's default inductor cache, unless the run pointed the
    compile caches first (``parity.run.worker.point_compile_caches``). Negative control: without that, both children
    are started anew and the note names the variable."""
    from parity.run.worker import SELF_SET

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in SELF_SET}
    env["PYTHONPATH"] = str(repo)
    code = ("import sys\n"
            "import parity.run.worker as worker\n"
            "if sys.argv[1] == 'off': worker.point_compile_caches = lambda *a, **k: {}\n"
            "from cli.main import main\n"
            "raise SystemExit(main(['run', '--suite', 'smoke', '--impl', 'megatron', '--limit', '2', '--workers', '2',\n"
            "                       '--device', 'cpu', '--out', sys.argv[2], '--quiet']))")
    seen = {}
    for how in ("on", "off"):
        out = tmp_path / how
        done = subprocess.run([sys.executable, "-c", code, how, str(out)], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        end = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()][-1]
        seen[how] = (end["occupancy"]["prestarted"], "TORCHINDUCTOR_CACHE_DIR" in done.stderr)
    assert seen == {"on": (2, False), "off": (0, True)}
