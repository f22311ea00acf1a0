"""One self-contained HTML page (inline CSS and JS, no network) for a batch of episodes.

Every token is a ``<span class="tok tok-{assistant|observation}">`` carrying its values in
``data-*`` attributes; a small script colours tokens by span or by a heat scale of a chosen value
and shows a tooltip. All text from models and tools goes through ``html.escape`` (and the tooltip
sets ``textContent``), so an observation holding ``<script>`` shows as text and never runs.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict

from agent_loop.inspect.tokens import is_success, segments, show_whitespace, turns
from agent_loop.inspect.values import ESTIMATORS, compare_summary
from agent_loop.inspect.view import InspectView
from masking.spans import SpanKind

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
header{position:sticky;top:0;z-index:3;background:#fff;border-bottom:1px solid #d8dde3;padding:8px 18px;
  display:flex;gap:18px;align-items:center;flex-wrap:wrap}
header h1{font-size:16px;margin:0}
main{padding:12px 18px;max-width:1400px}
h2{font-size:15px;margin:0 0 6px}
.card{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:10px 14px;margin:0 0 14px}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
th,td{border:1px solid #e1e5ea;padding:2px 8px;text-align:right;vertical-align:top}
th{background:#f0f2f5}
td.l,th.l{text-align:left}
.grid{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;color:#fff}
.ok{background:#2e8540}.fail{background:#c62828}
.warn{color:#8a5300;background:#fff4e0;border-color:#f0c36d}
.turn{border-left:3px solid #7aa6d8;padding-left:8px;margin:8px 0}
.turn-label{font-size:12px;color:#4a6d96;font-weight:600}
.tokens{font:13px/1.7 ui-monospace,SFMono-Regular,Menlo,monospace;white-space:pre-wrap;word-break:break-all}
.tok{border-radius:2px;box-shadow:inset -1px 0 0 rgba(0,0,0,.12);cursor:default}
.tok-assistant{background:#a8e6a8}
.tok-observation{background:#e2e4e8;color:#5a6270}
body.heat .tok{background:var(--heat,#fff)}
body.heat .tok-assistant{box-shadow:inset 0 -3px 0 #49a049}
body.heat .tok-observation{color:#8a93a0;text-decoration:underline dotted #9aa3ad}
.tok:hover{outline:2px solid #1d232b}
.err{color:#c62828;font-weight:600}
details pre{white-space:pre-wrap;word-break:break-all;font:12px ui-monospace,monospace;color:#555;max-height:18em;overflow:auto}
.key{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin:0 4px 0 10px}
#tip{position:fixed;display:none;z-index:5;background:#1d232b;color:#fff;padding:6px 9px;border-radius:5px;
  font:12px ui-monospace,monospace;pointer-events:none;white-space:pre}
svg.chart{width:100%;height:130px;background:#fcfcfd;border:1px solid #e1e5ea;border-radius:4px}
.legend span{margin-right:14px;font-size:12px}
"""

SCRIPT = """
(function(){
  const body=document.body, tip=document.getElementById('tip');
  const fields=[['row','episode'],['id','token id'],['pos','position'],['span','span'],['turn','turn'],['lp','logprob'],
    ['r','reward'],['ret','return'],['adv','advantage'],['reset','return, reset-at-observation'],
    ['ignore','return, ignore-mask']];
  function color(v,scale){
    if(!scale||!v)return '#ffffff';
    const a=Math.min(Math.abs(v)/scale,1);
    return v>0?`rgba(214,39,40,${0.12+0.78*a})`:`rgba(31,119,180,${0.12+0.78*a})`;
  }
  function paint(mode){
    const toks=document.querySelectorAll('.tok');
    if(mode==='span'){body.classList.remove('heat');return;}
    body.classList.add('heat');
    const group=(mode==='adv')?['adv']:['ret','reset','ignore'];
    let scale=0;
    toks.forEach(t=>group.forEach(k=>{const v=parseFloat(t.dataset[k]);if(v&&Math.abs(v)>scale)scale=Math.abs(v);}));
    toks.forEach(t=>t.style.setProperty('--heat',color(parseFloat(t.dataset[mode]),scale)));
    document.getElementById('scale').textContent=scale?`scale ±${scale.toPrecision(3)}`:'';
  }
  document.querySelectorAll('input[name=mode]').forEach(r=>r.addEventListener('change',e=>paint(e.target.value)));
  document.addEventListener('mouseover',e=>{
    const t=e.target.closest&&e.target.closest('.tok'); if(!t){tip.style.display='none';return;}
    const lines=['text'.padEnd(10)+'  '+JSON.stringify(t.textContent.replace(/\\u21b5\\n/g,'\\n'))];
    fields.forEach(([k,name])=>{if(t.dataset[k]!==undefined)lines.push(name.padEnd(10)+'  '+t.dataset[k]);});
    tip.textContent=lines.join('\\n'); tip.style.display='block';
  });
  // a page address ending in #ret, #adv, ... opens in that colour mode (links, screenshots)
  const start=document.querySelector(`input[name=mode][value="${CSS.escape(location.hash.slice(1))}"]`);
  if(start){start.checked=true;paint(start.value);}
  document.addEventListener('mousemove',e=>{tip.style.left=Math.min(e.clientX+14,innerWidth-tip.offsetWidth-4)+'px';
    tip.style.top=Math.min(e.clientY+14,innerHeight-tip.offsetHeight-4)+'px';});
})();
"""

CHART_COLORS = {"return": "#d62728", "advantage": "#1f77b4", "carry-through": "#d62728",
                "reset-at-observation": "#ff7f0e", "ignore-mask": "#7f3fbf"}
DASHES = {"reset-at-observation": "6 3", "ignore-mask": "2 3"}


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(x: float) -> str:
    return f"{x:.4g}"


def token_spans(view: InspectView, row: int, start: int, end: int, compare: bool) -> str:
    """The ``<span class="tok ...">`` elements of positions [start, end) of a row."""
    v, traj = view.values, view.trajectories[row]
    out = []
    for pos in range(start, end):
        span = SpanKind(traj.spans[pos])
        name = "assistant" if span == SpanKind.ASSISTANT else "observation"
        attrs = {
            "row": row, "id": traj.response_ids[pos], "pos": pos, "span": name, "turn": traj.turn_ids[pos],
            "lp": _num(traj.logprobs[pos]), "r": _num(float(v.token_level_rewards[row, pos])),
            "ret": _num(float(v.returns[row, pos])), "adv": _num(float(v.advantages[row, pos])),
        }
        if compare:
            attrs["reset"] = _num(float(v.compare["reset-at-observation"][row, pos]))
            attrs["ignore"] = _num(float(v.compare["ignore-mask"][row, pos]))
        data = " ".join(f'data-{k}="{esc(x)}"' for k, x in attrs.items())
        out.append(f'<span class="tok tok-{name}" {data}>{esc(show_whitespace(view.pieces[row][pos]))}</span>')
    return "".join(out)


def tool_table(view: InspectView, row: int, turn: int) -> str:
    calls = [c for c in view.trajectories[row].tool_calls if c.turn == turn]
    if not calls:
        return ""
    rows = []
    for c in calls:
        outcome = (f'<td class="l err">{esc(c.error_kind)}: {esc(c.error)}</td>' if c.error_kind
                   else f'<td class="l">{esc(c.result)}</td>')
        args = c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments, ensure_ascii=False)
        rows.append(f'<tr><td class="l">{esc(c.name)}</td><td class="l">{esc(args)}</td>{outcome}'
                    f"<td>{c.latency_s * 1000:.1f} ms</td></tr>")
    return ('<table class="tools"><tr><th class="l">tool</th><th class="l">arguments</th>'
            '<th class="l">result / error</th><th>latency</th></tr>' + "".join(rows) + "</table>")


def chart(view: InspectView, row: int, compare: bool) -> str:
    """Inline SVG: returns (and advantages, or the estimators with ``compare``) over response
    positions, observation runs shaded."""
    v, traj = view.values, view.trajectories[row]
    n = len(traj.response_ids)
    if n == 0:
        return ""
    series = ({name: v.compare[name][row, :n] for name in ESTIMATORS} if compare
              else {"return": v.returns[row, :n], "advantage": v.advantages[row, :n]})
    lo = round(min(0.0, *(float(s.min()) for s in series.values())), 9) + 0.0  # no float dust, no -0
    hi = round(max(0.0, *(float(s.max()) for s in series.values())), 9) + 0.0
    span = (hi - lo) or 1.0
    width, height, pad = 1000.0, 120.0, 8.0

    def x(pos: float) -> float:
        return pos * width / n

    def y(val: float) -> float:
        return pad + (hi - val) / span * (height - 2 * pad)

    shapes = [f'<rect x="{x(s.start):.1f}" y="0" width="{x(s.end) - x(s.start):.1f}" height="{height}" fill="#e2e4e8"/>'
              for s in segments(traj) if s.span == SpanKind.OBSERVATION]
    shapes.append(f'<line x1="0" x2="{width}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#999" stroke-width="0.5"/>')
    for name, values in series.items():
        points = " ".join(f"{x(p + 0.5):.1f},{y(float(val)):.1f}" for p, val in enumerate(values))
        dash = f' stroke-dasharray="{DASHES[name]}"' if name in DASHES else ""
        shapes.append(f'<polyline points="{points}" fill="none" stroke="{CHART_COLORS[name]}" stroke-width="1.6"'
                      f' vector-effect="non-scaling-stroke"{dash}/>')
    legend = "".join(f'<span style="color:{CHART_COLORS[k]}">━ {esc(k)}</span>' for k in series)
    return (f'<svg class="chart" viewBox="0 0 {width:.0f} {height:.0f}" preserveAspectRatio="none">{"".join(shapes)}</svg>'
            f'<div class="legend">{legend}<span style="color:#777">grey: observation tokens · '
            f"range {lo:.3g} … {hi:.3g}</span></div>")


def episode(view: InspectView, row: int, compare: bool) -> str:
    traj = view.trajectories[row]
    n_assistant = sum(1 for s in traj.spans if s == SpanKind.ASSISTANT)
    ok = is_success(traj)
    head = (f'<h2>episode {row} <span class="badge {"ok" if ok else "fail"}">{"success" if ok else "failed"}</span> '
            f"reward {traj.reward:g} · finish {esc(traj.finish_reason)}{' (truncated)' if traj.truncated else ''} · "
            f"{len(set(traj.turn_ids))} turns · {n_assistant} assistant / {len(traj.spans) - n_assistant} observation "
            f"tokens · line {view.lines[row]}</h2>")
    parts = [f'<section class="card episode" id="ep-{row}">', head,
             f"<details><summary>prompt ({len(traj.prompt_ids)} tokens)</summary><pre>{esc(view.prompts[row])}</pre></details>"]
    for turn, segs in turns(traj):
        parts.append(f'<div class="turn"><div class="turn-label">turn {turn}</div><div class="tokens">')
        parts.append(token_spans(view, row, segs[0].start, segs[-1].end, compare))
        parts.append("</div>" + tool_table(view, row, turn) + "</div>")
    if traj.turn_rewards is not None:
        parts.append(f"<div>turn rewards: {esc(traj.turn_rewards)}</div>")
    parts.append(chart(view, row, compare))
    parts.append("</section>")
    return "".join(parts)


def overview(view: InspectView, compare: bool) -> str:
    trajs = view.trajectories
    finish = Counter(t.finish_reason for t in trajs)
    errors = Counter(c.error_kind for t in trajs for c in t.tool_calls if c.error_kind)
    per_turn: dict[int, list[list[int]]] = defaultdict(lambda: [[], []])
    for t in trajs:
        for turn, segs in turns(t):
            a = sum(s.end - s.start for s in segs if s.span == SpanKind.ASSISTANT)
            per_turn[turn][0].append(a)
            per_turn[turn][1].append(sum(s.end - s.start for s in segs) - a)
    summary = (f"<table><tr><th>episodes</th><th>success rate</th><th>mean reward</th><th>tool calls</th>"
               f"<th>tool errors</th></tr><tr><td>{len(trajs)}</td><td>{sum(map(is_success, trajs)) / len(trajs):.0%}</td>"
               f"<td>{sum(t.reward for t in trajs) / len(trajs):.3f}</td><td>{sum(len(t.tool_calls) for t in trajs)}</td>"
               f"<td>{sum(errors.values())}</td></tr></table>")
    finish_table = ('<table><tr><th class="l">finish reason</th><th>episodes</th></tr>'
                    + "".join(f'<tr><td class="l">{esc(k)}</td><td>{n}</td></tr>' for k, n in finish.most_common())
                    + "".join(f'<tr><td class="l err">tool error: {esc(k)}</td><td>{n}</td></tr>' for k, n in errors.items())
                    + "</table>")
    turn_table = ('<table><tr><th>turn</th><th>episodes</th><th>mean assistant tokens</th>'
                  "<th>mean observation tokens</th></tr>"
                  + "".join(f"<tr><td>{k}</td><td>{len(a)}</td><td>{sum(a) / len(a):.1f}</td><td>{sum(o) / len(o):.1f}</td></tr>"
                            for k, (a, o) in sorted(per_turn.items()))
                  + "</table>")
    index = ('<table><tr><th>episode</th><th>line</th><th>reward</th><th class="l">finish</th><th>turns</th>'
             "<th>tokens</th></tr>"
             + "".join(f'<tr><td><a href="#ep-{r}">{r}</a></td><td>{view.lines[r]}</td><td>{trajs[r].reward:g}</td>'
                       f'<td class="l">{esc(trajs[r].finish_reason)}</td><td>{len(set(trajs[r].turn_ids))}</td>'
                       f"<td>{len(trajs[r].response_ids)}</td></tr>" for r in view.selected)
             + "</table>")
    parts = ['<section class="card"><h2>batch</h2><div class="grid">', summary, finish_table, turn_table,
             "</div><h2>episodes shown</h2>", index]
    if compare:
        parts.append(compare_table(view))
    parts.append("</section>")
    return "".join(parts)


def compare_table(view: InspectView) -> str:
    rows = "".join(
        f'<tr><td class="l">{esc(e.name)}</td><td class="l">{esc(e.description)}</td><td>{e.mean_return:.4f}</td>'
        f'<td class="{"err" if e.differing_tokens else ""}">{e.differing_tokens} / {e.assistant_tokens}</td>'
        f"<td>{e.mean_abs_diff:.4f}</td></tr>" for e in compare_summary(view.values))
    return (f"<h2>return estimators (gamma {view.values.gamma:g}, assistant tokens of the batch)</h2>"
            '<table class="compare"><tr><th class="l">estimator</th><th class="l">what it does</th><th>mean return</th>'
            "<th>tokens that differ from carry-through</th><th>mean |diff|</th></tr>" + rows + "</table>")


def render(view: InspectView, compare: bool = False) -> str:
    """The whole page as one string."""
    modes = [("span", "span"), ("ret", "return"), ("adv", "advantage")]
    if compare:
        modes += [("reset", "return, reset-at-observation"), ("ignore", "return, ignore-mask")]
    radios = "".join(f'<label><input type="radio" name="mode" value="{k}"{" checked" if k == "span" else ""}> {esc(label)}</label> '
                     for k, label in modes)
    keys = ('<span class="key" style="background:#a8e6a8"></span>assistant'
            '<span class="key" style="background:#e2e4e8"></span>observation')
    warnings = "".join(f'<div class="card warn">warning: {esc(p)}</div>' for p in view.problems)
    episodes = "".join(episode(view, r, compare) for r in view.selected) or '<div class="card warn">no episode matches the selection</div>'
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>agent-loop inspect: {esc(view.source)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{CSS}</style></head><body>"
        f"<header><h1>agent-loop inspect · {esc(view.source)}</h1><span>colour by: {radios}</span>"
        f'<span>{keys}</span><span id="scale"></span><span>gamma {view.values.gamma:g}</span></header>'
        f"<main>{warnings}{overview(view, compare)}{episodes}</main>"
        f'<div id="tip"></div><script>{SCRIPT}</script></body></html>'
    )
