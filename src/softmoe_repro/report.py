"""results.json -> report.md with PNG plots, every section putting our numbers beside the paper's.

``results.json`` holds one entry per experiment (``mnist_suite``, ``l2norm``, ...) next to the provenance of the
run (code version, date, machine). Each experiment module renders its own section with ``write_plots(results,
out_dir)`` and ``markdown(results, plots)``; this module only gathers them, in a fixed order.
"""

from __future__ import annotations

import datetime
import importlib
import platform
import subprocess
from pathlib import Path

import torch

import softmoe
from softmoe.checkpoint import atomic_write, read_json, write_json
from softmoe.runtime import cpu_model

SECTIONS = {
    "mnist_suite": "softmoe_repro.mnist_suite",
    "mnist_variants": "softmoe_repro.mnist_variants",
    "l2norm": "softmoe_repro.l2norm",
    "routers": "softmoe_repro.routers",
    "vit": "softmoe_repro.vit",
    "latency": "softmoe_repro.latency",
}


def code_version() -> str:
    """softmoe's version plus the git commit of the source tree when there is one (".dirty" when the source of the
    library or of the reproduction differs from that commit)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(  # both packages' source only: regenerated results are not code
            ["git", "status", "--porcelain", "--untracked-files=no", "--", str(Path(softmoe.__file__).parent), "."],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        ).stdout.strip()
        return f"{softmoe.__version__}+g{commit}{'.dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return softmoe.__version__


def provenance() -> dict:
    """When, with what code, and on what machine a result was made."""
    return {
        "code_version": code_version(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "processor": cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }


def collect_results(results_dir: str | Path) -> dict:
    """Gather every experiment JSON present in ``results_dir`` into ``results.json`` (atomically) and return it.

    When ``results.json`` already holds exactly these experiments it is left as it is, provenance included, so
    re-rendering a report never changes its data.
    """
    results_dir = Path(results_dir)
    results = {"provenance": provenance()}
    for key in SECTIONS:
        path = results_dir / f"{key}.json"
        if path.exists():
            results[key] = read_json(path)
    variants = sorted(results_dir.glob("mnist_suite_*.json"))
    if variants:  # other (model, protocol) pairs of the MNIST suite, shown beside the default one
        files = [results_dir / "mnist_suite.json"] * ("mnist_suite" in results) + variants
        results["mnist_variants"] = {path.stem: read_json(path) for path in files}
    if len(results) == 1:
        names = ", ".join(f"{key}.json" for key in SECTIONS if key != "mnist_variants")
        raise FileNotFoundError(f"no experiment results ({names}) in {results_dir}")
    path = results_dir / "results.json"
    if path.exists():
        previous = read_json(path)
        if {k: v for k, v in previous.items() if k != "provenance"} == {
            k: v for k, v in results.items() if k != "provenance"
        }:
            return previous
    write_json(path, results)
    return results


def write_report(results_dir: str | Path) -> Path:
    """Render ``results_dir/results.json`` as ``report.md`` with its plots beside it; returns the report's path."""
    results_dir = Path(results_dir)
    results = read_json(results_dir / "results.json")
    prov = results["provenance"]
    parts = [
        '# softmoe reproduction of "Beyond Parameter Count: Implicit Bias in Soft Mixture of Experts"',
        "",
        f"Assembled {prov['created']} with softmoe {prov['code_version']}, torch {prov['machine']['torch']}, "
        f"{prov['machine']['threads']} threads on {prov['machine']['processor']}, from the experiments' JSON files "
        "in this folder (each made by `softmoe reproduce` or the Table 3 benchmark). Every number below is in "
        "`results.json` beside this file.",
        "",
    ]
    for key, module_name in SECTIONS.items():
        if key not in results:
            continue
        module = importlib.import_module(module_name)
        plots = module.write_plots(results[key], results_dir)
        parts.append(module.markdown(results[key], plots))
    text = "\n".join(parts)
    path = results_dir / "report.md"

    def write(temp: str) -> None:
        Path(temp).write_text(text)

    atomic_write(path, write)
    return path
