"""``dsv4-parity gate``: every production path of an implementation in one gate (what ``make parity`` runs).

A **path** is one provider of the implementation, run as its own ordinary ``run`` and judged against its own baseline
(:mod:`reports.gate`). ``--paths auto`` asks the implementation (``parity.impls.Implementation.gate_paths``):

* ``--impl fused`` — the one ``--provider`` (as ``make parity`` always ran it);
* ``--impl megatron`` — production's **unfused** path (its default, ``dsa_kernel_backend="none"``) and its **fused**
  path: ``cudnn`` (the real kernels) where they run here, else ``emulated`` (its fused code over this project's torch
  kernels); ``--provider cudnn|emulated`` picks the fused path's provider.

``--paths P[,P]`` names them. Every other option is ``run``'s, passed to each path's run unchanged (``--provider``
and ``--out`` are set per path). ``--with-oracle NAME`` (repeatable) also runs that metamorphic oracle on the
``fused`` composition (the smoke suite), as ``make parity`` does on a CPU.

Output: one path — ``--out`` is its run directory; several — ``--out`` is a gate directory (``gate.json``,
``index.html`` side by side, ``<path>/`` per run; a ``--junit`` file merges the paths' suites). Oracle runs go beside
``--out`` (``<out>.oracle-<name>``). The command ends with one summary: a row per run, what each compared, why any
failed, the verdict and the report to open. Exit 0 when every run passed, 1 when one failed (a failing or erroring
case, an incomplete run, a drift or coverage loss against its baseline, a missing baseline), 2 for a usage error.
``--resume`` continues a killed gate: each path's recorded run, and the paths not started yet, judged as the gate was
started (its ``--baseline``, ``--with-oracle``, ``--baselines-dir`` and ``--provider``, defaults included; another value
given on the resume is a usage error), and executed with the gate's ``--workers`` / ``--isolate`` / ``--timeout`` unless
the resume gives others.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional, Sequence

from cases.errors import CaseError

from cli.options import add_implementation_options, add_output_options, add_selection_options

# The parser needs none of the engine: torch, the implementations and the report views load when the gate runs.

#: gate-only options (not passed to the runs) and whether each takes a value; then the run options set per path.
GATE_OPTIONS = {"--paths": True, "--baseline": True, "--with-oracle": True, "--baselines-dir": True}
PER_PATH = {"--provider": True, "--out": True, "--junit": True, "--make-default": False, "--no-report": False,
            "--resume": False}
FUSED_PROVIDERS = ("auto", "torch", "cudnn", "flashmla")
#: how a resumed gate's paths execute (``run --resume`` lets these differ from the recorded run): the value given on
#: the resume, else the one the gate was started with where that applies (:data:`FROM_THE_GATE` for a run resumed:
#: its recorded thread count is its own, and a budget was the first call's; every one for a path started afresh).
#: ``--workers`` and ``--isolate`` go together: one given on the resume leaves the other's recorded value out
#: (``--isolate none`` cannot run several workers).
EXECUTION = ("--workers", "--isolate", "--timeout", "--budget-s", "--threads")
FROM_THE_GATE = ("--workers", "--isolate", "--timeout")
PAIRED = ("--workers", "--isolate")


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    gate = subparsers.add_parser(
        "gate", help="every production path in one gate: a run per path, each against its own baseline",
        description=_plain(__doc__.split("\n\n", 1)[1]), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_options(gate)
    add_implementation_options(gate)
    gate.add_argument("--require", metavar="PROVIDER", help="as `run --require`, for every path")
    add_output_options(gate)
    gate.add_argument("--paths", default="auto", metavar="auto|P[,P]",
                      help="the providers to gate, one run each (default auto: the implementation's production paths)")
    gate.add_argument("--baseline", default="auto", metavar="auto|none|NAME|P=NAME,...",
                      help="each path's drift and coverage baseline: auto (ARCH/<its default name>; a missing one "
                           "fails the path), none (not gated against one), NAME (a gate of one path) or PATH=NAME "
                           "pairs")
    gate.add_argument("--with-oracle", action="append", default=[], metavar="NAME",
                      help="also run metamorphic oracle NAME on the fused composition, smoke suite (repeatable)")
    gate.add_argument("--baselines-dir", type=Path, default=None, help=argparse.SUPPRESS)  # None: the committed
    gate.set_defaults(func=gate_command)


def _plain(text: str) -> str:
    """The module docstring as plain text for ``--help`` (no reStructuredText markup)."""
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text)
    return text.replace("``", "`").replace("**", "")


def strip_options(tokens: Sequence[str], names: dict) -> list[str]:
    """``tokens`` without the options ``names`` (``{option: takes a value}``), in ``--opt V`` or ``--opt=V`` form."""
    out, skip = [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in names:
            skip = names[name] and "=" not in token
            continue
        out.append(token)
    return out


#: the options a resumed gate takes from its manifest (``dest``: (option, its value when the gate was started
#: without it)); ``--provider`` also picks the provider of the oracle runs a resume may still have to start
RECORDED_GATE_OPTIONS = {"baseline": ("--baseline", "auto"), "with_oracle": ("--with-oracle", None),
                         "baselines_dir": ("--baselines-dir", None), "provider": ("--provider", "auto")}


def option_values(tokens: Sequence[str], option: str) -> list[str]:
    """The values ``option`` takes in ``tokens`` (``--opt V`` and ``--opt=V``, in order)."""
    values = []
    for i, token in enumerate(tokens):
        if token == option and i + 1 < len(tokens):
            values.append(tokens[i + 1])
        elif token.startswith(option + "="):
            values.append(token.split("=", 1)[1])
    return values


def execution_options(tokens: Sequence[str], recorded: Sequence[str], fallback: Sequence[str]) -> list[str]:
    """The :data:`EXECUTION` options (and ``--quiet``) a resumed gate's path runs with: each given on the resume
    (``tokens``), else, for the options in ``fallback``, its value in the gate's ``recorded`` argv (a gate started
    with ``--workers auto`` and resumed keeps its workers: it ran the rest with one before)."""
    recorded = [str(t) for t in recorded]
    pair_given = any(option_values(tokens, option) for option in PAIRED)
    argv: list[str] = []
    for option in EXECUTION:
        falls_back = option in fallback and not (pair_given and option in PAIRED)
        values = option_values(tokens, option) or (option_values(recorded, option) if falls_back else [])
        if values:
            argv += [option, values[-1]]
    return argv + (["--quiet"] if "--quiet" in tokens or "--quiet" in recorded else [])


def apply_recorded_gate_options(args: argparse.Namespace, tokens: Sequence[str], manifest: dict,
                                out_dir: Path) -> None:
    """A resumed gate judges as the gate it continues: ``--baseline``, ``--with-oracle``, ``--baselines-dir`` and
    ``--provider`` are the ones in the manifest's ``argv`` — or their defaults, where the gate was started without
    them (a gate started with ``--baseline none`` is not failed for a missing baseline when resumed, and one started
    on its default baseline is not resumed without it). One given again must say the same; another value is a usage
    error naming the option. A manifest without ``argv`` (a run from before one-path gates kept theirs) records
    nothing: the options given on the resume stand."""
    if not manifest.get("argv"):
        return
    recorded_tokens = [str(t) for t in manifest["argv"]]
    for dest, (option, default) in RECORDED_GATE_OPTIONS.items():
        recorded, given = option_values(recorded_tokens, option), option_values(tokens, option)
        if dest != "with_oracle":  # one value: the last one given counts
            recorded = recorded[-1:] or ([default] if default is not None else [])
            given = given[-1:]
        if given and given != recorded:
            raise CaseError(option, f"conflicts with the gate being resumed ({out_dir}), which recorded "
                                    f"{' '.join(recorded) or 'none'!r}, not {' '.join(given)!r}; a resume continues "
                                    f"the recorded gate: drop {option} (judge the runs against another baseline with "
                                    f"`dsv4-parity report {out_dir} --baseline NAME`), or start a new gate")
        if dest == "with_oracle":
            setattr(args, dest, recorded)
        elif dest == "baselines_dir":
            setattr(args, dest, Path(recorded[0]) if recorded else None)
        else:
            setattr(args, dest, recorded[0])


def paths_of(args: argparse.Namespace) -> list[str]:
    """The providers to gate (``--paths``; auto: the implementation's production paths for ``--provider``)."""
    if args.paths and args.paths != "auto":
        names = [p.strip() for p in args.paths.split(",") if p.strip()]
        if not names or len(set(names)) != len(names):
            raise CaseError("paths", f"expected distinct providers, e.g. unfused,emulated; got {args.paths!r}")
        return names
    from parity.impls import load

    return load(args.impl).gate_paths(args.provider)


def _run(argv: list[str]) -> int:
    from cli.main import main  # noqa: PLC0415 — cli.main registers this module's parser

    return main(argv)


def _merge_junit(parts: list[tuple[str, Path]], target: Path) -> None:
    """One ``<testsuites>`` holding each path's ``<testsuite>`` (named and class-prefixed by its path)."""
    suites = ET.Element("testsuites")
    for name, path in parts:
        if not path.is_file():
            continue
        suite = ET.parse(path).getroot()
        suite.set("name", f"{suite.get('name', 'dsv4-parity')}.{name}")
        for case in suite.iter("testcase"):
            case.set("classname", f"{name}.{case.get('classname', '')}")
        suites.append(suite)
    target.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suites).write(target, encoding="utf-8", xml_declaration=True)


def gate_command(args: argparse.Namespace) -> int:
    from cli.report_command import _console  # noqa: PLC0415
    from parity.impls import ImplError
    from parity.run.runner import point_link
    from reports.baselines import BASELINES_ROOT
    from reports.errors import ReportError
    from reports.gate import INDEX, judge, parse_baselines, print_summary, title_of, write_index, write_manifest

    tokens = list(getattr(args, "argv", sys.argv[1:]))
    tokens = tokens[1:] if tokens and tokens[0] == "gate" else tokens
    try:
        out_dir, link, manifest, names = _plan(args, tokens)
        if args.resume:
            apply_recorded_gate_options(args, tokens, manifest, out_dir)
        baselines = parse_baselines(args.baseline, names)
        baselines_root = args.baselines_dir if args.baselines_dir is not None else BASELINES_ROOT
    except (CaseError, ImplError, ReportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if link is not None:
        point_link(link, out_dir)
    from cli.report_command import preload_report_modules  # noqa: PLC0415

    preload_report_modules()  # each path's report is drawn after its run: imported while the cases run
    run_tokens = strip_options(manifest["argv"], {**GATE_OPTIONS, **PER_PATH})
    multi = len(names) > 1
    if multi:
        write_manifest(out_dir, manifest)
    junits: list[tuple[str, Path]] = []
    for index, name in enumerate(names, 1):
        path_dir = out_dir / name if multi else out_dir
        if args.resume and (path_dir / "results.jsonl").is_file():  # its own recorded run, continued as recorded
            argv = ["run", "--out", str(path_dir), "--resume",
                    *execution_options(tokens, manifest.get("argv") or [], FROM_THE_GATE)]
        else:
            options = run_tokens
            if args.resume:  # not started before the gate was cut: its recorded options, executed as the resume says
                options = strip_options(run_tokens, {**dict.fromkeys(EXECUTION, True), "--quiet": False})
                options += execution_options(tokens, run_tokens, EXECUTION)
            argv = ["run", *options, "--provider", name, "--out", str(path_dir)]
            if not multi:  # the one run is the gate: its run row keeps the manifest for `gate --resume`
                argv += ["--gate-manifest", json.dumps({"type": "gate", **manifest})]
        if args.junit:
            argv += ["--junit", str(path_dir / "junit.xml" if multi else args.junit)]
            junits.append((name, path_dir / "junit.xml"))
        print(f"gate: path {index} of {len(names)}: {name} -> {path_dir}", file=sys.stderr, flush=True)
        if _run(argv) == 2:
            print(f"error: gate: the run of path {name} stopped on the error above (exit 2); the gate stops",
                  file=sys.stderr)
            return 2
    oracle_dirs = []
    for oracle in args.with_oracle:
        target = out_dir.parent / f"{out_dir.name}.oracle-{oracle}"
        if args.resume and (target / "results.jsonl").is_file():
            argv = ["run", "--out", str(target), "--resume", "--quiet"]
        else:
            provider = args.provider if args.provider in FUSED_PROVIDERS else "auto"
            argv = ["run", "--suite", "smoke", "--oracle", oracle, "--provider", provider, "--quiet", "--out",
                    str(target)] + (["--force"] if args.force else [])
        print(f"gate: oracle {oracle} (fused, smoke) -> {target}", file=sys.stderr, flush=True)
        if _run(argv) == 2:
            print(f"error: gate: the {oracle} oracle run stopped on the error above (exit 2)", file=sys.stderr)
            return 2
        oracle_dirs.append((oracle, target))
    if args.junit and multi:
        _merge_junit(junits, args.junit)

    console = _console()
    verdicts = [judge("path", name, out_dir / name if multi else out_dir, baselines[name], console=console,
                      baselines_root=baselines_root) for name in names]
    verdicts += [judge("oracle", f"{oracle} (fused, smoke)", target) for oracle, target in oracle_dirs]
    title = title_of(manifest)
    report = write_index(out_dir, verdicts, title=title) if multi else out_dir / INDEX
    print_summary(verdicts, console, title=title, report=report)
    return 0 if all(v.passed for v in verdicts) else 1


def _plan(args: argparse.Namespace, tokens: list[str]) -> tuple[Path, Optional[Path], dict, list[str]]:
    """``(out_dir, link to move or None, manifest, path names)``; a resumed gate reads them back."""
    from parity.impls import load
    from parity.run.resume import recorded_run
    from parity.run.runner import new_run_id, resolve_out_dir
    from reports.gate import read_manifest

    if args.resume:
        if not args.out:
            raise CaseError("resume", "needs --out DIR, the gate directory (or run directory) to continue")
        out_dir, _ = resolve_out_dir(args.out, "", False, True)
        manifest = read_manifest(out_dir)
        if manifest is not None:
            return out_dir, None, manifest, [str(p["name"]) for p in manifest["paths"]]
        recorded = recorded_run(out_dir)
        if recorded is None:
            raise CaseError("resume", f"{out_dir} holds no gate and no run to continue")
        manifest = recorded.get("gate")
        if not (isinstance(manifest, dict) and isinstance(manifest.get("paths"), list) and manifest["paths"]):
            # a run started before one-path gates recorded their manifest: its path is the provider it was asked for
            options = recorded.get("options") if isinstance(recorded.get("options"), dict) else {}
            provider = str(options.get("provider") or args.provider)
            manifest = {"argv": [], "impl": recorded.get("impl", args.impl), "suite": recorded.get("suite"),
                        "paths": [{"name": provider}]}
        return out_dir, None, manifest, [str(manifest["paths"][0]["name"])]
    names = paths_of(args)
    impl = load(args.impl)
    impl.check_ready()
    for name in names:
        impl.check_provider(name)
    label = args.suite or ("adhoc" if args.case or args.case_id else "smoke")
    gate_id = new_run_id(label, args.impl) + ("-gate" if len(names) > 1 else "")
    out_dir, link = resolve_out_dir(args.out, gate_id, args.make_default, False)
    manifest = {"gate_id": gate_id, "impl": args.impl, "suite": label, "argv": tokens,
                "paths": [{"name": n, "dir": n} for n in names]}
    return out_dir, link, manifest, names
