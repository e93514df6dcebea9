"""A results page's tables for a paper: each Markdown table of the page as a LaTeX table (booktabs, no other package),
and a CSV of every run. `tools/report.py write` writes both beside the page (`latex/<table>.tex`, `runs.csv`).

LaTeX, from the Markdown the page already shows, so the two carry the same numbers to the printed digit: mean ± std
over the seeds with the number of runs (the page's `n` column), the papers' own numbers as a separate column marked
as theirs (†), the best value of each score column in bold (higher is better, lower for ℓ_align, ℓ_uniform and
memory); a paired difference that exceeds two standard errors, bold on the page, gets an asterisk (bold is the
column's best here).
"""
from __future__ import annotations

import collections
import csv
import re
from pathlib import Path

from plumbing import provenance

STS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]
TRANSFER = ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC", "avg"]
NUMBER = re.compile(r"[-+−]?\d+(?:\.\d+)?")


# ------------------------------------------------------------------------------------------------ Markdown in
def markdown_tables(lines: list[str]) -> list[dict]:
    """The page's tables: {"title" (the heading above it), "header", "rows"} in page order."""
    tables, title, i = [], "table", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            title = lines[i].lstrip("#").strip()
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "")) <= set("-: "):
            header = cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append({"title": title, "header": header, "rows": rows})
            continue
        i += 1
    return tables


def cells(line: str) -> list[str]:
    """A Markdown table row's cells: split at the pipes that are not escaped, each cell's escapes undone."""
    inner = line.strip().removeprefix("|")
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [unescape_markdown(c.strip()) for c in re.split(r"(?<!\\)\|", inner)]


# ------------------------------------------------------------------------------------------------ Markdown out
MARKDOWN_SPECIAL = set("\\|*_`[]<>$&#~")


def markdown_cell(text) -> str:
    """Text shown as it is in a Markdown table cell (a row name from a protocol file, a swept value): CommonMark's
    backslash before each character Markdown or a table would read (a pipe would split the cell)."""
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in str(text)).replace("\n", " ")


def unescape_markdown(text: str) -> str:
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)


# ------------------------------------------------------------------------------------------------- LaTeX out
LATEX = {"\\": r"\textbackslash{}", **{c: "\\" + c for c in "&%$#_{}"}, "~": r"\textasciitilde{}",
         "^": r"\textasciicircum{}", "|": r"\textbar{}", "<": r"\textless{}",
         ">": r"\textgreater{}", "ℓ": r"$\ell$", "±": r"$\pm$", "×": r"$\times$", "−": "$-$", "—": "--", "`": ""}


def escape(text: str) -> str:
    """Text for LaTeX, each character once: its special characters escaped, the page's symbols in math mode."""
    return "".join(LATEX.get(c, c) for c in text)


def direction(column: str) -> int:
    """+1 where higher is better, -1 where lower is, 0 for a column that is not ranked."""
    name = column.lower()
    if name in ("n", "run", "row") or any(w in name for w in ("step", "paper", "−", "paired", "× simcse", "initial")):
        return 0
    return -1 if any(w in name for w in ("align", "uniform", "memory")) else 1


def mean_of(cell: str) -> float | None:
    found = NUMBER.match(cell.strip("*").strip())
    return float(found.group().replace("−", "-")) if found else None


def latex_cell(cell: str, best: bool) -> str:
    significant = cell.startswith("**") and cell.endswith("**")
    text = escape(cell.strip("*"))
    if significant:
        text += "$^{*}$"
    return rf"\textbf{{{text}}}" if best else text


def latex_table(table: dict, paper: dict[str, str] | None = None, label: str = "") -> str:
    """A booktabs table of `table`; `paper` {row: the paper's number} adds the papers' column (†). Rows that hold a
    paper's own cells or their difference to ours (the protocol pages') leave the body for that column."""
    header, rows = list(table["header"]), [list(r) for r in table["rows"]]
    rows = [r for r in rows if ": paper (" not in r[0] and ": ours − paper" not in r[0]]
    for r in rows:
        r[0] = r[0].removesuffix(": ours")
    if paper and not any("paper" in h for h in header):
        header.append("paper†")
        rows = [r + [paper.get(r[0], "—")] for r in rows]
    ranked_rows = [r for r in rows if not r[0].startswith("initial")]  # a starting point, not a method
    best = {}
    for j, column in enumerate(header):
        sign = direction(column)
        values = [mean_of(r[j]) for r in ranked_rows if j < len(r)] if sign else []
        ranked = [v for v in values if v is not None]
        if len(ranked) > 1:
            best[j] = max(ranked) if sign > 0 else min(ranked)
    body = [" & ".join(latex_cell(c, r in ranked_rows and j in best and mean_of(c) == best[j])
                       for j, c in enumerate(r)) + r" \\" for r in rows]
    note = r"\\ \footnotesize{\dag{} the paper's own number, not ours}" if "paper†" in header else ""
    return "\n".join([r"\begin{table}[t]", r"\centering", r"\small",
                      r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}", r"\toprule",
                      " & ".join(escape(h).replace("†", r"\dag{}") for h in header) + r" \\", r"\midrule", *body,
                      r"\bottomrule", r"\end{tabular}", rf"\caption{{{escape(table['title'])}{note}}}",
                      rf"\label{{tab:{label}}}" if label else "", r"\end{table}", ""])


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "table"


def write_latex(lines: list[str], folder: Path, papers: dict[str, dict[str, str]] | None = None) -> None:
    """Each Markdown table of a page as folder/<n>-<title>.tex; `papers`: {table title: {row: paper's number}}."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.tex"):  # the page's tables as they are now, none left from an older page
        old.unlink()
    for number, table in enumerate(markdown_tables(lines), start=1):
        name = f"{number:02d}-{slug(table['title'])}"
        (folder / f"{name}.tex").write_text(latex_table(table, (papers or {}).get(table["title"]), name))


# --------------------------------------------------------------------------------------------------- CSV out
CSV_COLUMNS = (["run", "script", "flags", "seed"] + [f"test_{t}" for t in STS] + [f"transfer_{t}" for t in TRANSFER]
               + ["best_dev_stsb", "best_step", "steps", "train_time_s", "commit", "uncommitted_changes"])


def run_row(name: str, script: str, flags: list[str], seed: int, results: dict) -> dict:
    """One run's CSV row from its results.json ("" where the run has no such number)."""
    git = (results.get("provenance") or {}).get("git")
    row = {"run": name, "script": script, "flags": " ".join(flags), "seed": seed,
           "best_dev_stsb": results.get("best_dev_stsb"), "best_step": results.get("best_step"),
           "steps": results.get("steps"), "train_time_s": results.get("train_time_s"),
           "commit": git["commit"] if isinstance(git, dict) else (git or ""),
           "uncommitted_changes": git.get("uncommitted_changes") if isinstance(git, dict) else None}
    for key, tasks in (("test", STS), ("transfer", TRANSFER)):
        row.update({f"{key}_{t}": (results.get(key) or {}).get(t) for t in tasks})
    return {k: "" if v is None else v for k, v in row.items()}


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------------ provenance
def provenance_lines(results: list[dict]) -> list[str]:
    """Which commits and library versions a page's runs came from, with a warning where they differ."""
    recorded = [r["provenance"] for r in results if r.get("provenance")]
    unknown = len(results) - len(recorded)
    commits = collections.Counter(provenance.commit_text(found) for found in recorded)
    versions = collections.Counter(", ".join(f"{k} {v}" for k, v in (found.get("versions") or {}).items()) or "unknown"
                                   for found in recorded)
    lines = []
    if commits:
        lines.append("Code: " + "; ".join(f"{c} ({n} run{'s' * (n > 1)})" for c, n in commits.items())
                     + (f"; {unknown} run(s) made before runs recorded their commit" if unknown else "") + ".")
        lines.append("Libraries: " + "; ".join(f"{v} ({n} run{'s' * (n > 1)})" for v, n in versions.items()) + ".")
        if len(commits) + bool(unknown) > 1 or len(versions) > 1:
            lines.append("**Warning**: these runs came from more than one commit or set of library versions; "
                         "compare rows with that in mind.")
    elif unknown:
        lines.append(f"Code: {unknown} run(s) made before runs recorded their commit and library versions.")
    return lines
