"""The inspect HTML pages in a real browser (headless Chromium): every token renders, the page's own
script runs (heat colours and their colour bar, the chart, the filters, the hover links between
tokens and chart points), no script from an observation runs, the two-run page lists its pairs, and
screenshots come out.

A test drives a page by appending a small script to a copy of it; the script writes what it saw as
JSON into ``<pre id="result">``, read back from ``--dump-dom``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_inspect import (  # noqa: F401 (fixtures)
    HOSTILE,
    batch,
    parse_tokens,
    rollouts,
    span_count,
    tokenizer,
    two_runs,
    view,
)

from agent_loop.inspect import html
from agent_loop.inspect.tokens import segments
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
    return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--window-size=1300,1800", *args],
                          capture_output=True, text=True, timeout=120)


def drive(chromium: str, tmp_path: Path, page: Path, script: str, hash_: str = "") -> tuple[dict, str]:
    """Load ``page`` with ``script`` appended; return what the script put in ``result`` and the DOM."""
    driven = tmp_path / f"driven-{abs(hash(script))}.html"
    driver = f"<script>(function(){{const out={{}};{script};" \
             "const pre=document.createElement('pre');pre.id='result';pre.textContent=JSON.stringify(out);" \
             "document.body.appendChild(pre);})();</script>"
    driven.write_text(page.read_text(encoding="utf-8").replace("</body>", driver + "</body>"), encoding="utf-8")
    result = run_chromium(chromium, tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", driven.as_uri() + hash_)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Uncaught" not in result.stderr, [line for line in result.stderr.splitlines() if "Uncaught" in line]
    found = re.search(r'<pre id="result">(.*?)</pre>', result.stdout, re.S)
    assert found, "the driver script did not run"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">")), result.stdout


@pytest.fixture(scope="module")
def page(view, tmp_path_factory) -> Path:  # noqa: F811 (view is a fixture)
    path = tmp_path_factory.mktemp("chromium") / "inspect.html"
    path.write_text(html.render(view, compare=True), encoding="utf-8")
    return path


@pytest.mark.integration
def test_dom_has_every_token_and_no_observation_script_ran(chromium, page, view, tmp_path):  # noqa: F811
    result = run_chromium(chromium, tmp_path, "--dump-dom", f"{page.as_uri()}#adv")
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    tokens = parse_tokens(dom)
    for kind, name in ((SpanKind.ASSISTANT, "assistant"), (SpanKind.OBSERVATION, "observation")):
        assert sum(t["kind"] == name for t in tokens) == span_count(view.trajectories, kind)
    # the page's own script ran: #adv opened the advantage heat colours, one colour per token
    assert re.search(r'<body class="heat">', dom)
    assert all("--h:" in (t["attrs"].get("style") or "") for t in tokens)
    # the observation's script did not: the title is ours, no element was added, the text is shown
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert title.startswith("agent-loop inspect") and "pwned" not in title
    assert "<pwned" not in dom and not re.search(r"<img[^>]*onerror", dom)
    assert HOSTILE in "".join(t["text"] for t in tokens if t["row"] == 2).replace("↵", "")


@pytest.mark.integration
def test_colour_bar_shows_the_scale(chromium, page, view, tmp_path):  # noqa: F811
    script = ("const cb=document.getElementById('colorbar');"
              "out.display=getComputedStyle(cb).display;out.name=document.getElementById('cb-name').textContent;"
              "out.lo=document.getElementById('cb-lo').textContent;out.hi=document.getElementById('cb-hi').textContent;"
              "out.bar=getComputedStyle(cb.querySelector('.bar')).backgroundImage;"
              "window.inspectPage.paint('span');out.hidden=getComputedStyle(cb).display")
    for mode, values in (("ret", [view.values.returns, *view.values.compare.values()]), ("adv", [view.values.advantages])):
        out, _ = drive(chromium, tmp_path, page, script, f"#{mode}")
        scale = max(float(v.abs().max()) for v in values)
        assert out["display"] != "none" and out["hidden"] == "none"  # shown in heat mode only
        assert out["name"] == html.NAMES[mode] + ":"
        assert float(out["hi"]) == pytest.approx(scale, rel=1e-3) and float(out["lo"]) == pytest.approx(-scale, rel=1e-3)
        assert "linear-gradient" in out["bar"]


@pytest.mark.integration
def test_filters_hide_episodes(chromium, page, view, tmp_path):  # noqa: F811
    script = ("const F=id=>document.getElementById(id), P=window.inspectPage;"
              "const visible=()=>[...document.querySelectorAll('section.episode')].filter(s=>!s.hidden).map(s=>+s.dataset.id);"
              "out.all=visible();F('f-failed').checked=true;P.filter();out.failed=visible();out.count=F('f-count').textContent;"
              "F('f-failed').checked=false;F('f-tools').checked=true;P.filter();out.tools=visible();"
              "F('f-tools').checked=false;F('f-finish').value='stop';P.filter();out.stop=visible();"
              "F('f-finish').value='';F('f-min').value='0.25';F('f-max').value='0.75';P.filter();out.range=visible();"
              "out.index=[...document.querySelectorAll('tr[data-ep]')].filter(r=>!r.hidden).map(r=>r.dataset.ep)")
    out, _ = drive(chromium, tmp_path, page, script)
    ids = [t.info["index"] for t in view.trajectories]
    assert out["all"] == ids
    assert out["failed"] == [t.info["index"] for t in view.trajectories if not t.success] == [11]
    assert out["count"] == f"showing 1 of {len(ids)} episodes in this page"
    assert out["tools"] == [t.info["index"] for t in view.trajectories if any(c.error_kind for c in t.tool_calls)]
    assert out["stop"] == [t.info["index"] for t in view.trajectories if t.finish_reason == "stop"]
    assert out["range"] == [12] and out["index"] == ["ep-12"]


CHART = dict(W=1000, L=52, R=8)


def positions(path: str, n: int) -> list[list[int]]:
    """The token positions of each subpath (M ... L ...) of a chart path."""
    runs = []
    for move in re.findall(r"M[^M]+", path):
        xs = [float(x) for x in re.findall(r"[ML]([\d.]+),", move)]
        runs.append([round((x - CHART["L"]) * n / (CHART["W"] - CHART["L"] - CHART["R"]) - 0.5) for x in xs])
    return runs


@pytest.mark.integration
def test_chart_gaps_on_observations_and_carries_the_return(chromium, page, view, tmp_path):  # noqa: F811
    script = ("out.charts=[...document.querySelectorAll('section.episode')].map(s=>({"
              "series:Object.fromEntries([...s.querySelectorAll('path.series')].map(p=>[p.dataset.key,p.getAttribute('d')])),"
              "carried:[...s.querySelectorAll('path.carried')].map(p=>[p.dataset.key,+p.dataset.start,+p.dataset.end,+p.dataset.value]),"
              "ticks:[...s.querySelectorAll('svg text')].length}))")
    out, _ = drive(chromium, tmp_path, page, script)
    v = view.values
    for row, (traj, chart) in enumerate(zip(view.trajectories, out["charts"])):
        n = len(traj.spans)
        assistant_runs = [list(range(s.start, s.end)) for s in segments(traj) if s.span == SpanKind.ASSISTANT]
        merged = []  # consecutive assistant segments of two turns form one run of the line
        for run in assistant_runs:
            if merged and merged[-1][-1] + 1 == run[0]:
                merged[-1] += run
            else:
                merged.append(run)
        assert positions(chart["series"]["ret"], n) == merged  # no point on an observation token
        assert positions(chart["series"]["reset"], n) == merged
        assert positions(chart["series"]["ignore"], n) == [list(range(n))]  # ignore-mask scans every token
        observation = [s for s in segments(traj) if s.span == SpanKind.OBSERVATION]
        held = [[k, s.start, s.end, pytest.approx(float(v.returns[row, s.end]) if s.end < n else 0.0, rel=1e-3, abs=1e-6)]
                for k in ("ret",) for s in observation]
        assert [c for c in chart["carried"] if c[0] == "ret"] == held
        assert [c for c in chart["carried"] if c[0] == "reset"] == [["reset", s.start, s.end, 0] for s in observation]
        assert chart["ticks"] >= 4  # the axes have labels


@pytest.mark.integration
def test_hover_links_tokens_and_chart(chromium, page, view, tmp_path):  # noqa: F811
    """Hover a token: the chart marks its point and the tooltip shows its values. Move over the chart:
    the token under the cursor is outlined."""
    traj, row = view.trajectories[2], 2
    obs = traj.spans.index(SpanKind.OBSERVATION)
    k = obs - 1  # the last assistant token before the observation
    n = len(traj.spans)
    script = (f"const s=document.querySelectorAll('section.episode')[{row}], toks=s.querySelectorAll('.seg>span');"
              f"toks[{k}].dispatchEvent(new MouseEvent('mouseover',{{bubbles:true}}));"
              "const dot=s.querySelector('circle.dot');out.dot=[dot.getAttribute('visibility'),+dot.getAttribute('cx'),+dot.getAttribute('cy')];"
              "out.tip=document.getElementById('tip').textContent;out.tipShown=document.getElementById('tip').style.display;"
              f"toks[{obs}].dispatchEvent(new MouseEvent('mouseover',{{bubbles:true}}));out.obsTip=document.getElementById('tip').textContent;"
              "const svg=s.querySelector('svg.chart'), r=svg.getBoundingClientRect();"
              f"const px=r.left+({CHART['L']}+({k}+0.5)*{(CHART['W'] - CHART['L'] - CHART['R'])}/{n})*r.width/{CHART['W']};"
              "svg.dispatchEvent(new MouseEvent('mousemove',{clientX:px,clientY:r.top+10,bubbles:true}));"
              "out.hl=[...toks].map((t,i)=>t.classList.contains('hl')?i:-1).filter(i=>i>=0)")
    out, _ = drive(chromium, tmp_path, page, script)
    assert out["dot"][0] == "visible" and out["tipShown"] == "block"
    assert out["dot"][1] == pytest.approx(CHART["L"] + (k + 0.5) * (CHART["W"] - CHART["L"] - CHART["R"]) / n, abs=0.1)
    fields = dict(re.match(r"(.+?)\s{2,}(.*)", line).groups() for line in out["tip"].splitlines())
    assert fields["token id"] == str(traj.response_ids[k]) and fields["position"] == str(k)
    assert fields["episode"] == str(traj.info["index"]) and fields["span"] == "assistant"
    assert float(fields["return"]) == pytest.approx(float(view.values.returns[row, k]), rel=1e-3)
    assert float(fields["advantage"]) == pytest.approx(float(view.values.advantages[row, k]), rel=1e-3)
    assert fields["text"] == json.dumps(view.pieces[row][k])
    held = float(view.values.returns[row, segments(traj)[1].end])
    assert float(re.search(r"R carried\s+(\S+) \(not a return", out["obsTip"]).group(1)) == pytest.approx(held, rel=1e-3)
    assert out["hl"] == [k]


@pytest.mark.integration
def test_two_run_page_lists_matched_pairs(chromium, two_runs, tmp_path):  # noqa: F811
    from agent_loop.inspect.runs import compare, render_html

    a, b, before, after = two_runs
    c = compare(a, b)
    path = tmp_path / "runs.html"
    path.write_text(render_html(c, None), encoding="utf-8")
    script = ("out.pairs=[...document.querySelectorAll('tr.pair')].map(r=>[+r.dataset.ep,...[...r.cells].slice(2).map(c=>c.textContent)]);"
              "out.views=[...document.querySelectorAll('section.pair-view')].map(s=>[s.id,s.dataset.divergence,"
              "s.querySelectorAll('.first').length,s.querySelectorAll('.run-A .seg>span').length,s.querySelectorAll('.run-B .seg>span').length])")
    out, _ = drive(chromium, tmp_path, path, script)
    by_index = {t.info["index"]: (t, u) for t in before for u in after if u.info["index"] == t.info["index"]}
    assert [p[0] for p in out["pairs"]] == sorted(by_index)
    for index, a_cell, b_cell, tokens in out["pairs"]:
        t, u = by_index[index]
        assert a_cell.startswith("ok" if t.info["success"] else "FAIL") and b_cell.startswith("ok" if u.info["success"] else "FAIL")
        assert (tokens == "same") == (t.response_ids == u.response_ids)
    assert len(out["views"]) == 3
    for ident, divergence, firsts, n_a, n_b in out["views"]:
        t, u = by_index[int(ident.removeprefix("pair-"))]
        assert (n_a, n_b) == (len(t.response_ids), len(u.response_ids))
        d = next(k for k, (x, y) in enumerate(zip(t.response_ids, u.response_ids)) if x != y)
        assert divergence == str(d) and firsts == 2  # the first differing token outlined in both runs


@pytest.mark.integration
def test_screenshot(chromium, page, tmp_path):
    shot = tmp_path / "inspect.png"
    result = run_chromium(chromium, tmp_path, f"--screenshot={shot}", page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    from matplotlib.image import imread

    image = imread(shot)
    assert image.shape[:2] == (1800, 1300)
    # the assistant green of the tokens is on screen (#a8e6a8)
    green = (abs(image[..., 0] - 0xA8 / 255) < 0.02) & (abs(image[..., 1] - 0xE6 / 255) < 0.02)
    assert int(green.sum()) > 1000
