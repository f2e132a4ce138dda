"""Every shell and Python block of the README and docs/ runs as written, in order, per
page, against a real redis-server (EFFECTMQ_REDIS_URL, as the pages tell a reader to set
it for a Redis that is not on localhost:6379). A block that cannot run here is marked
`<!-- not-run: why -->` and listed by test_blocks_not_run_say_why (tests/docs/blocks.py).
docs/kubernetes-walkthrough.md is left out: tests/cluster runs its blocks on a cluster."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.docs.blocks import NOT_CODE, PYTHON, SHELL, ROOT, Session, blocks, environment, pages

PAGES = [p.relative_to(ROOT).as_posix() for p in pages() if any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_as_written(page, redis_url, tmp_path):
    session = Session(tmp_path, environment(redis_url))
    try:
        for block in blocks(ROOT / page):
            if block.runs or block.file:
                done = session.run(block)
                assert done.returncode == 0, f"{block.where} ({block.lang}) exited {done.returncode}:\n" \
                                             f"{block.code}\n--- output ---\n{done.stdout[-4000:]}" \
                                             f"{session.earlier_output()}"
    finally:
        session.close()


def test_blocks_not_run_say_why():
    """The list of blocks not run, each with its reason (printed with -s)."""
    skipped = [b for p in pages() for b in blocks(p) if b.not_run is not None]
    for b in skipped:
        print(f"not run: {b.where}: {b.not_run}")
        assert len(b.not_run.split()) >= 3, f"{b.where}: say why the block cannot run here"
        assert b.lang in SHELL | PYTHON, f"{b.where}: a not-run marker on a {b.lang!r} block, which never runs"


def test_every_block_is_code_that_runs_or_says_what_it_is():
    """No command hides in a fence of another language, and file blocks are Python."""
    for page in pages():
        for b in blocks(page):
            assert b.lang in SHELL | PYTHON | NOT_CODE, f"{b.where}: fence language {b.lang!r}: use bash or python"
            if b.file is not None:
                assert b.lang in PYTHON and b.file.endswith(".py"), f"{b.where}: a file block is a Python module"
    # the extractor still finds the quickstart and the getting-started page's blocks
    assert sum(b.runs for b in blocks(ROOT / "README.md")) >= 1
    assert sum(b.runs for b in blocks(ROOT / "docs/getting-started.md")) >= 5


def test_queue_and_schedule_manifests_shown_are_valid():
    """A Queue or Schedule a page shows passes the CRDs' schemas and CEL rules, as the API
    server would check them (the loader of `effectmq local`)."""
    from effectmq_operator.local.manifests import API_VERSION, parse

    shown = [b for p in pages() for b in blocks(p) if b.lang == "yaml" and API_VERSION in b.code]
    assert shown, "no Queue or Schedule in the docs: the extractor is broken"
    for b in shown:
        documents = [d for d in yaml.safe_load_all(b.code) if d and d.get("apiVersion") == API_VERSION]
        assert parse(documents, b.where), b.where


TOP_FOLDERS = ("effectmq/", "operator/", "charts/", "tests/", "tooling/", "bench/", "examples/", "docs/", "gitops/",
               "worker_image/", "crds/")


def test_paths_the_pages_name_exist():
    """A file or folder of the checkout named in code (`effectmq/...`) or a link is there:
    a module moved by a refactoring leaves no reader looking for it."""
    missing = []
    for page in pages():
        text = page.read_text()
        for m in re.finditer(r"`([^`]+)`|\]\(([^)\s#]+)", text):
            for word in (m.group(1) or m.group(2)).split():
                path = word.strip("\"'(").rstrip(".,:;)\"'").split("::")[0]
                if path.startswith(TOP_FOLDERS) and not re.search(r"[<>*{}|$]", path):
                    if not (ROOT / path).exists():
                        missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []
