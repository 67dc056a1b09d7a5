"""The dead-link check of the built book (tools/check_links.py), on crafted pages, and the book's link settings."""

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_links  # noqa: E402  (a script folder, not a package)

ALLOW = {"https://arxiv.org/abs/1706.03762": "the paper"}


@pytest.fixture
def site(tmp_path):
    """A tiny build folder: index.html with anchors, a chapter, a static file, a theme template."""
    html = tmp_path / "html"
    (html / "chapters").mkdir(parents=True)
    (html / "_static").mkdir()
    (html / "index.html").write_text('<h1 id="top">t</h1><a name="old">o</a><a href="chapters/one.html#eq-1">1</a>')
    (html / "chapters" / "one.html").write_text('<p id="eq-1">x</p><img src="../_static/logo.svg">')
    (html / "_static" / "logo.svg").write_text("<svg/>")
    (html / "_static" / "macros.html").write_text('<a href="{{ pathto(x) }}">template, not a page</a>')
    return html


def problems(href: str, page: Path, root: Path, allowed=ALLOW, used=None) -> list[str]:
    return check_links.link_problems(href, page, allowed, lambda f: check_links.parse(f).ids, root, used)


@pytest.mark.parametrize(
    "href",
    ["https://github.com/x/y", "http://example.org", "mailto:a@b.c", "//cdn.example/x.js", "file:///etc/passwd"],
)
def test_links_with_a_scheme_or_a_host_are_external(href, site):
    assert check_links.classify(href, site / "index.html", site) == ("external", None, "")


def test_relative_links_resolve_against_the_page(site):
    page = site / "chapters" / "one.html"
    assert check_links.classify("../index.html#top", page, site) == ("internal", site / "index.html", "top")
    assert check_links.classify("#eq-1", page, site) == ("internal", page, "eq-1")
    assert check_links.classify("../index.html?x=1", page, site) == ("internal", site / "index.html", "")
    assert check_links.classify("../../secret.txt", page, site)[0] == "outside"


def test_good_links_pass(site):
    page = site / "chapters" / "one.html"
    for href in ["../index.html", "../index.html#top", "../index.html#old", "#eq-1", "#", "../_static/logo.svg", "../"]:
        assert problems(href, page, site) == [], href


@pytest.mark.parametrize(
    ("href", "complaint"),
    [
        ("../missing.html", "missing file"),
        ("../index.html#nowhere", "missing anchor"),
        ("#nowhere", "missing anchor"),
        ("../../outside.html", "leaves the build folder"),
        ("https://github.com/transformer-twice/transformer-twice", "not in external_links.txt"),
        ("https://arxiv.org/abs/1706.03762v2", "not in external_links.txt"),  # exact URLs only, no prefixes
    ],
)
def test_bad_links_are_reported(href, complaint, site):
    found = problems(href, site / "chapters" / "one.html", site)
    assert len(found) == 1 and complaint in found[0], found


def test_allowlisted_links_pass_and_count_as_used(site):
    used = set()
    assert problems("https://arxiv.org/abs/1706.03762", site / "index.html", site, used=used) == []
    assert used == {"https://arxiv.org/abs/1706.03762"}


def test_checker_reads_pages_not_templates_and_reports_unused_entries(site, tmp_path):
    allowlist = tmp_path / "allow.txt"
    allowlist.write_text("# comment\n\nhttps://arxiv.org/abs/1706.03762 the paper\n")
    checker = check_links.LinkChecker(root=site, allowlist=allowlist)
    found = checker.check_built_pages()
    assert sorted(p.relative_to(site).as_posix() for p in found) == ["chapters/one.html", "index.html"]
    assert all(v == [] for v in found.values()), found
    assert checker.checked == 2
    assert len(checker.unused()) == 1 and "1706.03762" in checker.unused()[0]
    (site / "index.html").write_text('<a href="https://arxiv.org/abs/1706.03762">paper</a><a href="nope.html">x</a>')
    found = check_links.LinkChecker(root=site, allowlist=allowlist).check_built_pages()
    assert found[site / "index.html"] == ["link to a missing file: nope.html"]


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("https://example.org/x", "no reason"),
        ("http://example.org/x plain http", "not an https"),
        ("chapters/x.html internal", "not an https"),
        ("https://example.org/x one\nhttps://example.org/x two", "listed twice"),
    ],
)
def test_allowlist_entries_need_https_and_a_reason(line, complaint, tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=complaint):
        check_links.load_allowlist(path)


def test_project_allowlist_is_valid():
    for url, reason in check_links.load_allowlist().items():
        assert url.startswith("https://") and len(reason) > 10, url


def test_config_has_no_remote_buttons():
    """Jupyter Book's defaults point at its own repository and Binder: the config must switch every one off."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    html, launch = config["html"], config["launch_buttons"]
    assert not html["use_repository_button"] and not html["use_issues_button"] and not html["use_edit_page_button"]
    assert config["repository"]["url"] == ""
    assert all(launch[k] == "" for k in ("binderhub_url", "jupyterhub_url", "colab_url")), launch
    assert launch["thebe"] is False
