"""The inspect HTML page in a real browser (headless Chromium): it renders every token, its own
script runs (heat colours), no script from an observation runs, and a screenshot comes out."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_inspect import HOSTILE, batch, parse_tokens, qwen_dir, rollouts, span_count, tokenizer, view  # noqa: F401 (fixtures)

from agent_loop.inspect import html
from masking.spans import SpanKind

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def chromium() -> str:
    """The chromium binary; installed with apt-get (Debian package ``chromium``) where missing."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        if subprocess.run(install, capture_output=True, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
            subprocess.run(install, capture_output=True, env=env, timeout=600)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium is not installed and `apt-get install -y chromium` was not possible here")
    return found


def run_chromium(chromium: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(view, tmp_path_factory) -> Path:  # noqa: F811 (view is a fixture)
    path = tmp_path_factory.mktemp("chromium") / "inspect.html"
    path.write_text(html.render(view, compare=True), encoding="utf-8")
    return path


@pytest.mark.slow
def test_dom_has_every_token_and_no_observation_script_ran(chromium, page, view, tmp_path):  # noqa: F811
    result = run_chromium(chromium, tmp_path, "--dump-dom", f"{page.as_uri()}#adv")
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    tokens = parse_tokens(dom)
    for kind, name in ((SpanKind.ASSISTANT, "assistant"), (SpanKind.OBSERVATION, "observation")):
        assert sum(t["class"] == f"tok tok-{name}" for t in tokens) == span_count(view.trajectories, kind)
    # the page's own script ran: #adv opened the advantage heat colours, one colour per token
    assert re.search(r'<body class="heat">', dom)
    assert all("--heat:" in (t["attrs"].get("style") or "") for t in tokens)
    # the observation's script did not: the title is ours, no element was added, the text is shown
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert title.startswith("agent-loop inspect") and "pwned" not in title
    assert "<pwned" not in dom and not re.search(r"<img[^>]*onerror", dom)
    assert HOSTILE in "".join(t["text"] for t in tokens if t["attrs"]["data-row"] == "2").replace("↵", "")


@pytest.mark.slow
def test_screenshot(chromium, page, tmp_path):
    shot = tmp_path / "inspect.png"
    result = run_chromium(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1300,1800", page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    from matplotlib.image import imread

    image = imread(shot)
    assert image.shape[:2] == (1800, 1300)
    # the assistant green of the tokens is on screen (#a8e6a8)
    green = (abs(image[..., 0] - 0xA8 / 255) < 0.02) & (abs(image[..., 1] - 0xE6 / 255) < 0.02)
    assert int(green.sum()) > 1000


@pytest.mark.slow
def test_tooltip_shows_the_token_values(chromium, page, view, tmp_path):  # noqa: F811
    """Hover the first observation token of episode 2 (via a test driver script appended to a copy
    of the page) and read the tooltip from the DOM; the page must log no script error."""
    traj, row = view.trajectories[2], 2
    pos = traj.spans.index(SpanKind.OBSERVATION)
    driver = ("<script>const t=document.querySelector('.tok[data-row=\"2\"][data-pos=\"%d\"]');"
              "t.dispatchEvent(new MouseEvent('mouseover',{bubbles:true}));</script>" % pos)
    hovered = tmp_path / "hovered.html"
    hovered.write_text(page.read_text(encoding="utf-8").replace("</body>", driver + "</body>"), encoding="utf-8")
    result = run_chromium(chromium, tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", hovered.as_uri())
    assert result.returncode == 0
    assert "Uncaught" not in result.stderr
    tip = re.search(r'<div id="tip" style="([^"]*)">(.*?)</div>', result.stdout, re.S)
    assert "display: block" in tip.group(1)
    fields = dict(re.match(r"(.+?)\s{2,}(.*)", line).groups() for line in tip.group(2).splitlines())
    assert fields["token id"] == str(traj.response_ids[pos])
    assert fields["position"] == str(pos) and fields["turn"] == str(traj.turn_ids[pos])
    assert fields["span"] == "observation" and fields["episode"] == str(row)
    assert float(fields["return"]) == pytest.approx(float(view.values.returns[row, pos]), abs=1e-6)
    assert float(fields["advantage"]) == pytest.approx(float(view.values.advantages[row, pos]), abs=1e-6)
    assert fields["text"] == json.dumps(view.pieces[row][pos])
