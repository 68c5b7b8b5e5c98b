# SPDX-License-Identifier: Apache-2.0
"""Every relative link in the user documents (README.md, docs/*.md) points at a file that exists,
and every #anchor at a heading of its target: the documents send a reader to result files and
sections by path, and those move when results are re-run or sections are renamed."""
import glob
import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    with open(path) as f:
        for line in f:
            m = re.match(r"#+\s+(.*)", line)
            if m:
                text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
                out.add(text.replace(" ", "-"))
    return out


def _links(path):
    with open(path) as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        yield target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(doc):
    bad = []
    for target in _links(doc):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, f"{os.path.relpath(doc, ROOT)}: " + "; ".join(bad)


def test_the_check_sees_a_broken_link(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# Title\n[ok](d.md#title) [gone](nothing.md) [anchor](d.md#nope)\n")
    assert list(_links(str(doc))) == ["d.md#title", "nothing.md", "d.md#nope"]
    assert _anchors(str(doc)) == {"title"}
