"""One self-contained HTML page from the report's blocks: inline CSS, every plot embedded as a
base64 PNG, no script and no external reference, so the file can be mailed or attached as is."""

from __future__ import annotations

import base64
import html
import re

from trex.report.document import Block

STYLE = """body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1em}th,td{border:1px solid #bbb;padding:0.25em 0.5em;text-align:left}
th{background:#eee}code{background:#f4f4f4;padding:0 0.2em}img{max-width:100%;border:1px solid #ddd}
.source{color:#666;font-size:0.85em}"""


def inline(text: str) -> str:
    """Escape ``text``, then `code` -> <code>, **bold** -> <strong>."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def png_data_uri(path: str) -> str:
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode("ascii")


def render(blocks: list[Block], title: str) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>"]
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            parts.append(f"<{b.kind}>{inline(b.text)}</{b.kind}>")
        elif b.kind == "p":
            parts.append(f"<p>{inline(b.text)}</p>")
        elif b.kind == "table":
            parts.append("<table>")
            parts.append("<tr>" + "".join(f"<th>{inline(h)}</th>" for h in b.header) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in b.rows]
            parts.append("</table>")
        elif b.kind == "img":
            parts.append(f'<p><img src="{png_data_uri(b.path)}" alt="{html.escape(b.path)}"></p>')
        elif b.kind == "source":
            parts.append(f'<p class="source">source: <code>{html.escape(b.path)}</code></p>')
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"
