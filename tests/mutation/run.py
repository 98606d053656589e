"""Mutation testing: plant each bug of mutants.toml in a scratch copy of the repository and
run the tests named for it; a bug the tests do not notice is a survivor.

    python tests/mutation/run.py            # every mutant (make mutate)
    python tests/mutation/run.py --fast     # the CI subset (make mutate-ci)
    python tests/mutation/run.py --only ID  # one mutant (repeatable)
    python tests/mutation/run.py --check    # every `find` occurs once; nothing runs

Mutants run --jobs at a time (default: one per CPU), each in its copy with its tests in
namespaces of their own; a mutant's tests still run one after another.

The copy gets its own C core when a mutant changes csrc/ (the extension, built with the
project's cffi build script, and libpdhal.so), and runs with PYTHONPATH pointing at it, so
the installed editable checkout is never touched. Mutants claimed equivalent are proven so
for C (identical object code) and listed apart, not counted. Exit status 1 when the score
is below --min-score (90%), or, with --fast, when any mutant survives.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON = sys.executable
TEST_TIMEOUT_S = 300  # a mutant that makes the tests hang is killed by the hang


def load(path: str) -> list[dict]:
    with open(path, "rb") as f:
        mutants = tomllib.load(f)["mutant"]
    seen = set()
    for m in mutants:
        assert m["id"] not in seen, f"duplicate mutant id {m['id']}"
        seen.add(m["id"])
        assert ("tests" in m) != ("equivalent" in m), f"{m['id']}: tests or equivalent"
    return mutants


def check_finds(mutants: list[dict]) -> list[str]:
    """Problems with the mutants' `find` texts against the current sources."""
    problems = []
    for m in mutants:
        with open(os.path.join(ROOT, m["file"])) as f:
            count = f.read().count(m["find"])
        if count != 1:
            problems.append(f"{m['id']}: `find` occurs {count} times in {m['file']}")
    return problems


def snapshot() -> str:
    """The repository's files (tracked and new, not ignored) plus its built C core (the
    extension and the standalone libpdhal.so) and simulated runtimes, copied once: later
    edits to the checkout do not leak into the run."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    built = glob.glob(os.path.join(ROOT, "pdhal", "*.so")) + glob.glob(
        os.path.join(ROOT, "backends", "*", "pdhal_*", "sim", "build", "*.so")
    )
    dest = tempfile.mkdtemp(prefix="pdhal-mutate-base-")
    for rel in files + [os.path.relpath(p, ROOT) for p in built]:
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    return dest


def scratch_copy(base: str) -> str:
    """A fresh copy of the snapshot for one mutant."""
    dest = tempfile.mkdtemp(prefix="pdhal-mutant-")
    shutil.copytree(base, dest, dirs_exist_ok=True, symlinks=True)
    return dest


def apply(copy: str, m: dict) -> None:
    path = os.path.join(copy, m["file"])
    with open(path) as f:
        text = f.read()
    assert text.count(m["find"]) == 1, f"{m['id']}: find text not unique in {m['file']}"
    with open(path, "w") as f:
        f.write(text.replace(m["find"], m["replace"]))


def build_c_core(copy: str) -> str | None:
    """Rebuild the copy's C core as setup.py does: pdhal._pdhal_c and libpdhal.so (what C
    programs outside Python link). None when both built, else the compiler's output."""
    for old in glob.glob(os.path.join(copy, "pdhal", "*.so")):
        os.remove(old)
    # cffi compiles in tmpdir with the build script's relative source paths: the copy's root.
    code = (
        "import sys, subprocess; sys.path.insert(0, 'csrc'); import build_ffi as b; "
        "b.ffibuilder.compile(tmpdir='.'); "
        "subprocess.run(['gcc', '-shared', '-fPIC', *b.compile_args(), '-Ipdhal/include', "
        "*['csrc/' + s for s in b.SOURCES], '-o', 'pdhal/libpdhal.so', "
        "*b.link_args(b.CDEF, python_module=False), '-lpthread'], check=True)"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=copy, capture_output=True, text=True)
    built = [
        glob.glob(os.path.join(copy, "pdhal", name)) for name in ("_pdhal_c*.so", "libpdhal.so")
    ]
    if proc.returncode != 0 or not all(built):
        return proc.stdout + proc.stderr
    return None


def object_code(source_root: str, rel: str) -> bytes:
    """The .text of one C file of csrc/, compiled as the extension compiles it."""
    out = tempfile.mktemp(suffix=".o")
    subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-O2",
            "-fPIC",
            "-c",
            f"-I{source_root}/pdhal/include",
            f"-I{source_root}/csrc",
            "-o",
            out,
            os.path.join(source_root, rel),
        ],
        check=True,
    )
    text = out + ".text"
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", out, text], check=True)
    with open(text, "rb") as f:
        data = f.read()
    os.remove(out)
    os.remove(text)
    return data


#: The simulated runtime a conformance-kit run binds (as `make test` runs the kit).
KIT_RUNTIMES = {"xpu": "PDHAL_XPURT", "cuda": "PDHAL_CUDART"}


#: Where the in-tree distributions beside pdhal live: each is a folder with its pyproject.toml
#: and its package folder inside it (transports/mooncake/pdhal_mooncake), so that folder is
#: what goes on the path. tests/plugins/* are fixtures the tests install themselves: left out.
DISTRIBUTIONS = ("backends/*", "transports/*", "connectors/*", "demo")


def import_roots(copy: str) -> list[str]:
    """The copy's root and every in-tree distribution's folder in it: each goes on
    PYTHONPATH ahead of the editable installs (whose finders come after sys.path), so a
    mutant anywhere in the tree is the code its tests import."""
    roots = [copy]
    for pattern in DISTRIBUTIONS:
        for found in sorted(glob.glob(os.path.join(copy, pattern, "pyproject.toml"))):
            roots.append(os.path.dirname(found))
    return roots


def env_for(copy: str, test: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(import_roots(copy))
    if test.startswith("kit:") and test[4:] in KIT_RUNTIMES:
        env[KIT_RUNTIMES[test[4:]]] = subprocess.run(
            [PYTHON, "-m", f"pdhal_{test[4:]}.testing"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return env


#: A test name's prefix -> the pytest option that runs that kit against the name after it.
KITS = {"kit:": "--pdhal-backend", "transport-kit:": "--pdhal-transport"}


def command(run: tuple[str, ...]) -> list[str]:
    """What runs these tests: a make target or a kit alone, pytest ids in one pytest."""
    first = run[0]
    if first.startswith("make:"):
        return ["make", "-s", first[5:]]
    pytest = [PYTHON, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    for prefix, option in KITS.items():
        if first.startswith(prefix):
            return [*pytest, option, first[len(prefix) :]]
    return [*pytest, *run]


#: Mutants run side by side: one writes the last failure's log at a time.
_FAILURE_LOG = threading.Lock()


def _log_failure(argv: list[str], output: str) -> None:
    """Keep the last failing run's whole output, for a look at why it failed."""
    path = os.path.join(tempfile.gettempdir(), "pdhal-mutate-last-failure.log")
    with _FAILURE_LOG, open(path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n{output}")


def run_tests(copy: str, runs: list[tuple[str, ...]]) -> str | None:
    """None when every run passed; else which one failed (or timed out)."""
    for run in runs:
        test = " ".join(run)
        # A session of its own, so a timeout takes the tests' child processes down too.
        proc = subprocess.Popen(
            command(run),
            cwd=copy,
            env=env_for(copy, run[0]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"{test}: timed out"
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if proc.returncode != 0:
            _log_failure(command(run), proc.stdout + proc.stderr)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return f"{test}: exit {proc.returncode}: " + " | ".join(tail)
    return None


def run_one(base: str, m: dict) -> tuple[str, str]:
    """(outcome, detail): killed, survived, stillborn (did not build) or equivalent."""
    copy = scratch_copy(base)
    try:
        apply(copy, m)
        if "equivalent" in m:
            if m["file"].endswith(".c") and object_code(copy, m["file"]) != object_code(
                base, m["file"]
            ):
                return "error", "claimed equivalent, but its object code differs"
            return "equivalent", m["equivalent"]
        if m["file"].startswith("csrc/"):
            failed = build_c_core(copy)
            if failed:
                return "stillborn", failed.strip().splitlines()[-1]
        elif m["file"].endswith(".py"):
            try:  # a mutant that is not Python kills every test by not importing
                compile(open(os.path.join(copy, m["file"])).read(), m["file"], "exec")
            except SyntaxError as e:  # IndentationError too
                return "stillborn", f"{type(e).__name__}: {e}"
        failed = run_tests(copy, [(test,) for test in m["tests"]])
        return ("killed", failed) if failed else ("survived", "every named test passed")
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def baseline(base: str, mutants: list[dict]) -> None:
    """The named tests must pass without any mutant, or a 'kill' would mean nothing."""
    copy = scratch_copy(base)
    try:
        failed = run_tests(copy, baseline_runs({t for m in mutants for t in m.get("tests", [])}))
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if failed:
        sys.exit(f"mutate: the tests fail without any mutant ({failed}); fix them first")


def baseline_runs(tests: set[str]) -> list[tuple[str, ...]]:
    """The named tests in as few runs as they go in: each make target and kit alone, every
    pytest id in one pytest (less an id inside a file named too: the file runs it). One
    start where there were sixty saves CI minutes."""
    alone = sorted(t for t in tests if t.startswith(("make:", *KITS)))
    files = {t for t in tests if "::" not in t}
    together = sorted(
        t for t in tests if t not in alone and ("::" not in t or t.split("::")[0] not in files)
    )
    return [(t,) for t in alone] + ([tuple(together)] if together else [])


def module_of(m: dict) -> str:
    return m["file"].split("/")[0] if m["file"].startswith("backends/") else m["file"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the CI subset (fast = true)")
    parser.add_argument("--only", action="append", metavar="ID", help="run just this mutant")
    parser.add_argument("--check", action="store_true", help="check the find texts and stop")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip running the named tests unmutated first"
    )
    parser.add_argument(
        "--min-score",
        type=float,
        default=0.9,
        help="fail below this share of non-equivalent mutants killed (0.9)",
    )
    parser.add_argument("--mutants", default=os.path.join(HERE, "mutants.toml"))
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="mutants at a time (one per CPU)"
    )
    args = parser.parse_args(argv)
    mutants = load(args.mutants)
    problems = check_finds(mutants)
    if problems or args.check:
        print("\n".join(problems) or f"{len(mutants)} mutants, every find text unique")
        return 1 if problems else 0
    if args.only:
        unknown = set(args.only) - {m["id"] for m in mutants}
        if unknown:
            parser.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m["id"] in args.only]
    elif args.fast:
        mutants = [m for m in mutants if m.get("fast")]
    base = snapshot()
    try:
        if not args.no_baseline:
            baseline(base, mutants)
        results = run_all(base, mutants, args.jobs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report(results, args)


def run_all(base: str, mutants: list[dict], jobs: int) -> dict[str, list[tuple[dict, str, str]]]:
    """Each mutant's outcome, `jobs` mutants at a time, printed in the order of `mutants`."""

    def timed(m: dict) -> tuple[str, str, float]:
        start = time.monotonic()
        return (*run_one(base, m), time.monotonic() - start)

    results: dict[str, list[tuple[dict, str, str]]] = collections.defaultdict(list)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for m, (outcome, detail, seconds) in zip(mutants, pool.map(timed, mutants)):
            results[outcome].append((m, outcome, detail))
            print(f"{outcome:>10}  {m['id']:<34} {seconds:5.0f} s  {detail}", flush=True)
    return results


def report(results: dict[str, list[tuple[dict, str, str]]], args) -> int:
    """Print the score per module and what survived; the exit status."""
    counted = [r for outcome in ("killed", "survived") for r in results[outcome]]
    print("\nscore per module (killed / planted, equivalent ones left out):")
    per_module: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for m, outcome, _ in counted:
        per_module[module_of(m)][1] += 1
        per_module[module_of(m)][0] += outcome == "killed"
    for module, (killed, total) in sorted(per_module.items()):
        print(f"  {module:<40} {killed:3d} / {total:3d}")
    killed = len(results["killed"])
    score = killed / len(counted) if counted else 1.0
    print(
        f"\nkilled {killed} of {len(counted)} ({100 * score:.0f}%); "
        f"equivalent {len(results['equivalent'])}; stillborn {len(results['stillborn'])}"
    )
    for m, _, detail in results["equivalent"]:
        print(f"  equivalent: {m['id']}: {detail}")
    for m, _, _ in results["survived"]:
        print(f"  SURVIVED: {m['id']} ({m['file']}): {m['why']}")
    for m, _, detail in results["stillborn"] + results["error"]:
        print(f"  BROKEN MUTANT: {m['id']}: {detail}")
    if results["stillborn"] or results["error"]:
        return 1
    if args.fast:
        return 1 if results["survived"] else 0
    return 0 if score >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
