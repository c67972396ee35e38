"""`--format html`: one self-contained page, tables sortable by a click, charts embedded as base64 PNG.

Nothing is fetched: no server, no scripts, styles or fonts from elsewhere, so the file opens anywhere.
"""

import base64
import html

import pandas as pd

from .board import Board
from .charts import board_colours, latency_chart, roofline_chart
from .formats import board_title, by_workload_display, ranking_display, results_display

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
th[data-order="asc"]::after { content: " ▲"; } th[data-order="desc"]::after { content: " ▼"; }
td:nth-child(-n+2) { text-align: left; }
img { max-width: 100%; display: block; margin: 1em 0; }
.notes { color: #555; }
"""

# Click a header to sort by it; "1.23x", "50%" and "3/4" sort by their leading number.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(table => {
  table.dataset.sortReady = "yes";
  table.querySelectorAll("thead th").forEach((header, column) => header.addEventListener("click", () => {
    const ascending = header.dataset.order !== "asc";
    table.querySelectorAll("thead th").forEach(h => delete h.dataset.order);
    header.dataset.order = ascending ? "asc" : "desc";
    const key = row => { const text = row.cells[column].textContent.trim(), n = parseFloat(text);
                         return isNaN(n) ? [1, text] : [0, n]; };
    const rows = Array.from(table.tBodies[0].rows).sort((a, b) => {
      const [x, y] = [key(a), key(b)];
      if (x[0] !== y[0]) return x[0] - y[0];  // numbers first, blanks and text last, either way
      const order = x[1] < y[1] ? -1 : x[1] > y[1] ? 1 : 0;
      return ascending ? order : -order;
    });
    rows.forEach(row => table.tBodies[0].appendChild(row));
  }));
});
"""


RULES = ("Ranked by workloads passed, then by the geometric-mean speedup over the baseline on the timed workloads "
         "both passed; the reference is the denominator of 'vs reference', listed first and not ranked. Workloads "
         "tagged smoke check correctness: they count in passed/total, not in speedups, fast_p, win rate, % SOL and "
         "spread (unless --include-smoke). Spread: half the 95% confidence interval of the median, in % of it. "
         "A hash marked stale measured other content than the solution's folder holds now. A solution has one "
         "colour in every chart of this page. Click a column header to sort.")


def html_page(boards: list[Board], definition: str) -> str:
    title = f"flashbench leaderboard: {definition}"
    body = [f"<h1>{html.escape(title)}</h1>", f"<p class=notes>{html.escape(RULES)}</p>"]
    colours = board_colours(boards)
    for board in boards:
        body += board_section(board, colours)
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + f"\n<script>{SORT_SCRIPT}</script>\n"
            "</body></html>\n")


def board_section(board: Board, colours: dict[str, str]) -> list[str]:
    hardware = html.escape(board.hardware)
    return [
        f"<h2 id={hardware}>{html.escape(board_title(board))}</h2>",
        "<ul class=notes>" + "".join(f"<li>{html.escape(note)}</li>" for note in board.notes) + "</ul>",
        _table(ranking_display(board)),
        _image(latency_chart(board, colours), f"latency per workload on {board.hardware_name}"),
        _image(roofline_chart(board, colours), f"roofline on {board.hardware_name}"),
        "<h3>Per workload (µs)</h3>", _table(by_workload_display(board)),
        "<h3>Every result</h3>", _table(results_display(board)),
    ]


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, classes="sortable", border=0, na_rep="", escape=True)


def _image(png: bytes, description: str) -> str:
    data = base64.b64encode(png).decode()
    return f'<img alt="{html.escape(description)}" src="data:image/png;base64,{data}">'
