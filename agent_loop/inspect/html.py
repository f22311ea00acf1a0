"""One self-contained HTML page (inline CSS and JS, no network) for the episodes of a file, or for
two runs side by side (:func:`render_runs`).

Tokens are plain ``<span>`` elements inside one ``<span class="seg a|o">`` per run of assistant
(``a``) or observation (``o``) tokens; their values (ids, logprobs, rewards, returns, advantages)
are one JSON block of numbers per page, read by the page's script: the heat colours and their
colour bar, the tooltip, the per-episode chart (drawn from the same numbers, with gaps on
observation tokens and the carried return dashed across them; hovering a token marks its point,
hovering the chart marks its token) and the in-page filters. All text from models and tools goes
through ``html.escape`` (the script only sets ``textContent``), so an observation holding
``<script>`` shows as text and never runs.
"""

from __future__ import annotations

import html
import json

from agent_loop.inspect.terminal import problem_lines
from agent_loop.inspect.tokens import show_whitespace, turns, versions_note
from agent_loop.inspect.view import (
    InspectView,
    carried_on,
    continues_note,
    episode_label,
    episodes_text,
    row_values_note,
    segment_note,
)
from agent_loop.options import plural, rate
from masking.spans import SpanKind

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
header{position:sticky;top:0;z-index:3;background:#fff;border-bottom:1px solid #d8dde3;padding:6px 18px;
  display:flex;gap:8px 18px;align-items:center;flex-wrap:wrap}
header h1{font-size:16px;margin:0}
main{padding:12px 18px;max-width:1400px}
h2{font-size:15px;margin:0 0 6px}
.card{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:10px 14px;margin:0 0 14px}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
th,td{border:1px solid #e1e5ea;padding:2px 8px;text-align:right;vertical-align:top}
th{background:#f0f2f5}
td.l,th.l{text-align:left}
.grid{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.session{color:#7a1f8a;font-weight:600}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;color:#fff}
.ok{background:#2e8540}.fail{background:#c62828}
.warn{color:#8a5300;background:#fff4e0;border-color:#f0c36d}
.turn{border-left:3px solid #7aa6d8;padding-left:8px;margin:8px 0}
.turn-label{font-size:12px;color:#4a6d96;font-weight:600}
.tokens{font:13px/1.7 ui-monospace,SFMono-Regular,Menlo,monospace;white-space:pre-wrap;word-break:break-all}
.seg>span{border-radius:2px;box-shadow:inset -1px 0 0 rgba(0,0,0,.12)}
.a>span{background:#a8e6a8}.o>span{background:#e2e4e8;color:#5a6270}
body.heat .seg>span{background:var(--h,#fff)}
body.heat .a>span{box-shadow:inset 0 -3px 0 #49a049}
body.heat .o>span{color:#8a93a0;text-decoration:underline dotted #9aa3ad}
.seg>span:hover,.seg>span.hl{outline:2px solid #1d232b}
.err{color:#c62828;font-weight:600}
.div>span{outline:1px dashed #c62828}.first{outline:2px solid #c62828!important}
details pre{white-space:pre-wrap;word-break:break-all;font:12px ui-monospace,monospace;color:#555;max-height:18em;overflow:auto}
.key{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin:0 4px 0 10px}
#tip{position:fixed;display:none;z-index:5;background:#1d232b;color:#fff;padding:6px 9px;border-radius:5px;
  font:12px ui-monospace,monospace;pointer-events:none;white-space:pre}
#colorbar{display:none;align-items:center;gap:6px;font-size:12px}
body.heat #colorbar{display:inline-flex}
#colorbar .bar{width:160px;height:12px;border:1px solid #999;
  background:linear-gradient(to right,rgba(31,119,180,.9),rgba(31,119,180,.12) 49.9%,#fff 50%,rgba(214,39,40,.12) 50.1%,rgba(214,39,40,.9))}
.filters{font-size:13px}.filters input[type=number]{width:5em}
svg.chart{width:100%;height:auto;background:#fcfcfd;border:1px solid #e1e5ea;border-radius:4px;display:block}
svg.chart text{font:11px system-ui,sans-serif;fill:#555}
.legend span{margin-right:14px;font-size:12px}
.runs{display:grid;grid-template-columns:1fr 1fr;gap:14px}.runs h3{font-size:14px;margin:4px 0}
"""

# the page's script: the data is in <script type="application/json" id="data">
SCRIPT = r"""
(function(){
const D=JSON.parse(document.getElementById('data').textContent), body=document.body, tip=document.getElementById('tip');
const SVG='http://www.w3.org/2000/svg', W=1000, H=170, L=52, R=8, T=8, B=24;
const rows=[]; // per section: {el, toks, d}
document.querySelectorAll('section.episode').forEach(el=>{
  const d=D.rows[+el.dataset.row], toks=[...el.querySelectorAll('.seg>span')];
  toks.forEach((t,k)=>{t._r=rows.length;t._k=k;});
  rows.push({el,toks,d}); if(d&&!el.dataset.nochart)chart(rows[rows.length-1]);
});
function fmt(v){return v===undefined||v===null?'':(+v).toPrecision(4).replace(/\.?0+(e|$)/,'$1');}
function isA(d,k){return d.spans[k]==='1';}
function carried(d,key){ // the value held across each observation run: at the next assistant token (after the last:
  // d.tail, the next segment's first return where the session goes on, else 0)
  const out=[]; let k=0; const n=d.spans.length;
  while(k<n){ if(isA(d,k)){k++;continue;} let e=k; while(e<n&&!isA(d,e))e++;
    out.push([k,e,key==='reset'?0:(e<n?d[key][e]:(key==='ret'&&d.tail)||0)]); k=e; }
  return out;
}
function chart(row){
  const d=row.d, n=d.spans.length; if(!n)return;
  const series=D.compare?[['ret','#d62728',''],['reset','#ff7f0e',''],['ignore','#7f3fbf','2 3']]:[['ret','#d62728',''],['adv','#1f77b4','']];
  let lo=0,hi=0; series.forEach(([k])=>d[k].forEach(v=>{if(v<lo)lo=v;if(v>hi)hi=v;}));
  if(-lo<(hi-lo)*1e-3)lo=0; if(hi<(hi-lo)*1e-3)hi=0; if(hi===lo)hi=lo+1; // no tick for float dust
  const x=p=>L+(p+0.5)*(W-L-R)/n, y=v=>T+(hi-v)/(hi-lo)*(H-T-B);
  const svg=document.createElementNS(SVG,'svg'); svg.setAttribute('viewBox',`0 0 ${W} ${H}`); svg.setAttribute('class','chart');
  const add=(tag,attrs,text)=>{const e=document.createElementNS(SVG,tag);for(const a in attrs)e.setAttribute(a,attrs[a]);if(text!==undefined)e.textContent=text;svg.appendChild(e);return e;};
  carried(d,'ret').forEach(([s,e])=>add('rect',{x:x(s-0.5),y:T,width:x(e-0.5)-x(s-0.5),height:H-T-B,fill:'#e2e4e8','class':'band'}));
  // axes: y ticks at lo, 0, hi; x ticks at round positions
  add('line',{x1:L,x2:L,y1:T,y2:H-B,stroke:'#888'}); add('line',{x1:L,x2:W-R,y1:H-B,y2:H-B,stroke:'#888'});
  [...new Set([lo,0,hi])].forEach(v=>{add('line',{x1:L-4,x2:W-R,y1:y(v),y2:y(v),stroke:v===0?'#999':'#eee'});
    add('text',{x:L-6,y:y(v)+4,'text-anchor':'end'},fmt(v));});
  const step=[1,2,5,10,20,50,100,200,500,1000,2000,5000].find(s=>n/s<=12)||10000;
  for(let p=0;p<n;p+=step){add('line',{x1:x(p),x2:x(p),y1:H-B,y2:H-B+4,stroke:'#888'});add('text',{x:x(p),y:H-6,'text-anchor':'middle'},p);}
  series.forEach(([k,color,dash])=>{ // a gap on every non-assistant token, except ignore-mask (it scans them)
    let path='',on=false;
    for(let p=0;p<n;p++){ if(k!=='ignore'&&!isA(d,p)){on=false;continue;}
      path+=(on?'L':'M')+x(p).toFixed(1)+','+y(d[k][p]).toFixed(1); on=true; }
    add('path',{d:path,fill:'none',stroke:color,'stroke-width':1.6,'stroke-dasharray':dash,'class':'series','data-key':k});
    if(k==='ret'||k==='reset')carried(d,k).forEach(([s,e,v])=>add('path',{d:`M${x(s-0.5).toFixed(1)},${y(v).toFixed(1)}L${x(e-0.5).toFixed(1)},${y(v).toFixed(1)}`,
      stroke:color,'stroke-width':1.4,'stroke-dasharray':'6 4',fill:'none','class':'carried','data-key':k,'data-value':v,'data-start':s,'data-end':e}));
  });
  const cursor=add('line',{y1:T,y2:H-B,stroke:'#1d232b','stroke-width':1,visibility:'hidden','class':'cursor'});
  const dot=add('circle',{r:4,fill:'#1d232b',visibility:'hidden','class':'dot'});
  row.mark=k=>{ if(k===null){cursor.setAttribute('visibility','hidden');dot.setAttribute('visibility','hidden');return;}
    cursor.setAttribute('x1',x(k));cursor.setAttribute('x2',x(k));cursor.setAttribute('visibility','visible');
    const v=isA(d,k)?d.ret[k]:carried(d,'ret').find(([s,e])=>s<=k&&k<e)[2];
    dot.setAttribute('cx',x(k));dot.setAttribute('cy',y(v));dot.setAttribute('visibility','visible');};
  svg.addEventListener('mousemove',e=>{const r=svg.getBoundingClientRect();
    const k=Math.max(0,Math.min(n-1,Math.floor(((e.clientX-r.left)*W/r.width-L)*n/(W-L-R))));
    rows.forEach(o=>o.toks.forEach(t=>t.classList.remove('hl'))); row.toks[k].classList.add('hl'); row.mark(k); show(row,k,e);});
  svg.addEventListener('mouseleave',()=>{row.toks.forEach(t=>t.classList.remove('hl'));row.mark(null);tip.style.display='none';});
  const legend=document.createElement('div'); legend.className='legend';
  legend.innerHTML=series.map(([k,c,dash])=>`<span style="color:${c}">${dash?'┈':'━'} ${D.names[k]}</span>`).join('')+
    '<span style="color:#d62728">╌ R carried across an observation (red, dashed, over the grey observation band)</span>';
  row.el.querySelector('.chart-slot').append(svg,legend);
}
function show(row,k,e){
  const d=row.d, t=row.toks[k], a=isA(d,k);
  const lines=[['text',JSON.stringify(t.textContent.replace(/\u21b5\n/g,'\n'))],['episode',row.el.dataset.id],['position',k],
    ['span',a?'assistant':'observation'],['token id',d.ids[k]],['turn',d.turn[k]]];
  if(a&&d.ver)lines.push(['policy version',d.ver[k]]);
  if(a){lines.push(['logprob',fmt(d.lp[k])],['reward',fmt(d.r[k])],['return',fmt(d.ret[k])],['advantage',fmt(d.adv[k])]);
    if(D.compare)lines.push(['return, reset-at-observation',fmt(d.reset[k])],['return, ignore-mask',fmt(d.ignore[k])]);}
  else lines.push(['R carried',fmt(carried(d,'ret').find(([s,e])=>s<=k&&k<e)[2])+' (not a return of this token)']);
  tip.textContent=lines.map(([a,b])=>a.padEnd(10)+'  '+b).join('\n'); tip.style.display='block';
  if(e){tip.style.left=Math.min(e.clientX+14,innerWidth-tip.offsetWidth-4)+'px';tip.style.top=Math.min(e.clientY+14,innerHeight-tip.offsetHeight-4)+'px';}
}
document.addEventListener('mouseover',e=>{
  const t=e.target.closest&&e.target.closest('.seg>span');
  rows.forEach(o=>o.mark&&o.mark(null));
  if(!t||t._r===undefined){if(!(e.target.closest&&e.target.closest('svg.chart')))tip.style.display='none';return;}
  const row=rows[t._r]; if(row.mark)row.mark(t._k); show(row,t._k,e);
});
function heat(v,s){if(!s||!v)return '#ffffff';const a=Math.min(Math.abs(v)/s,1);
  return v>0?`rgba(214,39,40,${0.12+0.78*a})`:`rgba(31,119,180,${0.12+0.78*a})`;}
function paint(mode){
  if(mode==='span'){body.classList.remove('heat');return;}
  body.classList.add('heat');
  const group=mode==='adv'?['adv']:['ret','reset','ignore']; let s=0;
  rows.forEach(({d})=>d&&group.forEach(k=>(d[k]||[]).forEach(v=>{if(Math.abs(v)>s)s=Math.abs(v);})));
  rows.forEach(({d,toks})=>d&&toks.forEach((t,k)=>t.style.setProperty('--h',heat(d[mode][k],s))));
  document.getElementById('cb-lo').textContent=fmt(-s); document.getElementById('cb-hi').textContent=fmt(s);
  document.getElementById('cb-name').textContent=D.names[mode]+':';
}
document.querySelectorAll('input[name=mode]').forEach(r=>r.addEventListener('change',e=>paint(e.target.value)));
const F=id=>document.getElementById(id);
function filter(){
  const failed=F('f-failed').checked, finish=F('f-finish').value, tools=F('f-tools').checked;
  const lo=F('f-min').value===''?-Infinity:+F('f-min').value, hi=F('f-max').value===''?Infinity:+F('f-max').value;
  let shown=0;
  rows.forEach(({el})=>{const r=+el.dataset.reward;
    const hide=(failed&&el.dataset.ok==='1')||(finish&&el.dataset.finish!==finish)||(tools&&el.dataset.toolerr==='0')||r<lo||r>hi;
    el.hidden=hide; const link=document.querySelector(`tr[data-ep="${el.id}"]`); if(link)link.hidden=hide; if(!hide)shown++;});
  F('f-count').textContent=`showing ${shown} of ${rows.length} episodes in this page`;
}
['f-failed','f-finish','f-tools','f-min','f-max'].forEach(id=>F(id)&&F(id).addEventListener('input',filter));
if(F('f-failed'))filter();
// a page address ending in #ret, #adv, ... opens in that colour mode (links, screenshots)
const start=document.querySelector(`input[name=mode][value="${CSS.escape(location.hash.slice(1))}"]`);
if(start){start.checked=true;paint(start.value);}
window.inspectPage={paint,filter,rows,show};
})();
"""

NAMES = {"ret": "return (carry-through)", "adv": "advantage", "reset": "return, reset-at-observation",
         "ignore": "return, ignore-mask"}


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def numbers(values) -> list:
    """Floats rounded to 4 significant digits, integers where exact (short JSON)."""
    out = []
    for x in values:
        x = float(f"{float(x):.4g}")
        out.append(int(x) if x.is_integer() else x)
    return out


def token_html(view: InspectView, row: int, start: int, end: int, mark_from: int | None = None) -> str:
    """The tokens of positions [start, end) of a row: one ``seg`` per run of equal span kind.
    ``mark_from``: tokens from there on get the ``div`` class (the two-run view), the first ``first``."""
    traj, pieces, out, pos = view.trajectories[row], view.pieces[row], [], start
    while pos < end:
        kind, stop = traj.spans[pos], pos
        while stop < end and traj.spans[stop] == kind:
            stop += 1
        cls = "a" if kind == SpanKind.ASSISTANT else "o"
        if mark_from is not None and pos <= mark_from < stop:  # split the run where the sequences part
            head = "".join(f"<span>{esc(show_whitespace(p))}</span>" for p in pieces[pos:mark_from])
            tail = "".join(f'<span{" class=first" if k == mark_from else ""}>{esc(show_whitespace(pieces[k]))}</span>'
                           for k in range(mark_from, stop))
            out.append(f'<span class="seg {cls}">{head}</span><span class="seg {cls} div">{tail}</span>')
        else:
            div = " div" if mark_from is not None and pos > mark_from else ""
            out.append(f'<span class="seg {cls}{div}">'
                       + "".join(f"<span>{esc(show_whitespace(p))}</span>" for p in pieces[pos:stop]) + "</span>")
        pos = stop
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


def row_data(view: InspectView, row: int, compare: bool) -> dict:
    """The numbers of one row for the page's script (``spans``: a string of 1/2 per token)."""
    v, traj = view.values, view.trajectories[row]
    n = len(traj.response_ids)
    data = {"spans": "".join(str(int(s)) for s in traj.spans), "ids": traj.response_ids, "turn": traj.turn_ids,
            "lp": numbers(traj.logprobs), "r": numbers(v.token_level_rewards[row, :n]),
            "ret": numbers(v.returns[row, :n]), "adv": numbers(v.advantages[row, :n])}
    if traj.policy_versions is not None:
        data["ver"] = traj.policy_versions
    if (tail := carried_on(view, row)) is not None:
        data["tail"] = numbers([tail])[0]
    if compare:
        data["reset"] = numbers(v.compare["reset-at-observation"][row, :n])
        data["ignore"] = numbers(v.compare["ignore-mask"][row, :n])
    return data


def episode_attrs(view: InspectView, row: int) -> str:
    traj = view.trajectories[row]
    return (f'data-row="{row}" data-id="{view.ids[row]}" data-ok="{int(traj.success)}" '
            f'data-finish="{esc(traj.finish_reason)}" data-toolerr="{sum(1 for c in traj.tool_calls if c.error_kind)}" '
            f'data-reward="{traj.reward:g}"')


def episode_head(view: InspectView, row: int) -> str:
    traj = view.trajectories[row]
    n_assistant = sum(1 for s in traj.spans if s == SpanKind.ASSISTANT)
    ok = traj.success
    why = f' · <i>{esc(view.reasons[row])}</i>' if view.reasons[row] else ""
    segment = segment_note(view, row)
    session = (f'<div class="session">episode {view.ids[row]}: one session of {view.segments[row]} segments (its agent '
               "rewrote its history), shown in order; its returns run across them</div>"
               if segment and traj.segment == 0 else "")
    return (session + f'<h2>{esc(episode_label(view, row))} <span class="badge {"ok" if ok else "fail"}">{"success" if ok else "failed"}</span> '
            f"reward {traj.reward:g} · finish {esc(traj.finish_reason)}{' (truncated)' if traj.truncated else ''} · "
            f"{plural(len(set(traj.turn_ids)), 'turn')} · {n_assistant} assistant / {len(traj.spans) - n_assistant} "
            f"observation tokens · line {view.lines[row]}{why}"
            + (f" · {esc(versions_note(traj))}" if traj.policy_versions else "") + "</h2>"
            f'<div class="values-note">values: {esc(row_values_note(view, row))}</div>')


def episode(view: InspectView, row: int) -> str:
    traj = view.trajectories[row]
    parts = [f'<section class="card episode" id="{anchor(view, row)}" {episode_attrs(view, row)}>', episode_head(view, row),
             f"<details><summary>prompt ({plural(len(traj.prompt_ids), 'token')})</summary><pre>{esc(view.prompts[row])}</pre></details>"]
    for turn, segs in turns(traj):
        parts.append(f'<div class="turn"><div class="turn-label">turn {turn}</div><div class="tokens">')
        parts.append(token_html(view, row, segs[0].start, segs[-1].end))
        parts.append("</div>" + tool_table(view, row, turn) + "</div>")
    if traj.turn_rewards is not None:
        parts.append(f"<div>turn rewards: {esc(traj.turn_rewards)}</div>")
    if traj.reward == 0 and not any(traj.turn_rewards or []):
        parts.append('<div class="err">every return of this episode is 0 (reward 0); its advantages only '
                     "reflect the file's mean</div>")
    if note := continues_note(view, row):
        parts.append(f'<div class="session">↳ {esc(note)}</div>')
    parts.append('<div class="chart-slot"></div></section>')
    return "".join(parts)


def anchor(view: InspectView, row: int) -> str:
    """The page anchor of a row: ``ep-7``, and ``ep-7-s1`` for segment 1 of session 7."""
    segment = view.trajectories[row].segment
    return f"ep-{view.ids[row]}" + (f"-s{segment}" if segment else "")


def overview(view: InspectView, compare: bool) -> str:
    s, n = view.summary, max(view.summary.episodes, 1)
    summary = (f"<table><tr><th>episodes</th><th>success rate</th><th>mean reward</th><th>mean turns</th><th>tool calls</th>"
               f"<th>tool errors</th><th>reward errors</th><th>template mismatches</th></tr>"
               f"<tr><td>{esc(episodes_text(s))}</td><td>{rate(s.successes / n)}</td>"
               f"<td>{s.reward_sum / n:.3f}</td><td>{s.turns / n:.2f}</td><td>{s.tool_calls}</td>"
               f"<td>{sum(s.tool_errors.values())}</td><td class=\"{'err' if s.reward_errors else ''}\">{s.reward_errors}</td>"
               f"<td class=\"{'err' if s.template_mismatches else ''}\">{s.template_mismatches}</td></tr></table>"
               + problems_html(view))
    records = "segments" if s.segments != s.episodes else "episodes"  # a finish reason is a segment's own
    finish_table = (f'<table><tr><th class="l">finish reason</th><th>{records}</th></tr>'
                    + "".join(f'<tr><td class="l">{esc(k)}</td><td>{c}</td></tr>' for k, c in s.finish_reasons.most_common())
                    + "".join(f'<tr><td class="l err">tool error: {esc(k)}</td><td>{c}</td></tr>'
                              for k, c in s.tool_errors.most_common())
                    + "</table>")
    turn_table = ('<table><tr><th>turn</th><th>episodes</th><th>mean assistant tokens</th>'
                  "<th>mean observation tokens</th></tr>"
                  + "".join(f"<tr><td>{k}</td><td>{c}</td><td>{a / c:.1f}</td><td>{o / c:.1f}</td></tr>"
                            for k, (c, a, o) in sorted(s.per_turn.items()))
                  + "</table>")
    trajs = view.trajectories
    index = ('<table><tr><th>episode</th><th>line</th><th>reward</th><th class="l">finish</th><th>turns</th>'
             "<th>tokens</th></tr>"
             + "".join(f'<tr data-ep="{anchor(view, r)}"><td><a href="#{anchor(view, r)}">{view.ids[r]}</a>'
                       f"{esc(' · ' + segment_note(view, r)) if segment_note(view, r) else ''}</td>"
                       f"<td>{view.lines[r]}</td><td>{trajs[r].reward:g}</td>"
                       f'<td class="l">{esc(trajs[r].finish_reason)}</td><td>{len(set(trajs[r].turn_ids))}</td>'
                       f"<td>{len(trajs[r].response_ids)}</td></tr>" for r in range(len(trajs)))
             + "</table>")
    episodes = view.episode_count()
    held = (f"this page holds {episodes} of the {view.matching} episodes that match the selection"
            + (" (the first ones in file order; --max-episodes, --episode, --worst, --failed choose others)"
               if episodes < view.matching else ""))
    parts = [f'<section class="card"><h2>file: {esc(episodes_text(s))}</h2><div class="grid">', summary, finish_table,
             turn_table, f'</div><h2>episodes in this page</h2><p class="{"err" if episodes < view.matching else ""}">'
             f"{esc(held)}</p>", f"<details{' open' if len(trajs) <= 12 else ''}><summary>index of the episodes in this page"
             f"</summary>{index}</details>"]
    if compare:
        parts.append(compare_table(view))
    parts.append("</section>")
    return "".join(parts)


def problems_html(view: InspectView) -> str:
    """The summary's problem lines (reward errors with their first messages, ...), one paragraph each."""
    return "".join(f'<p class="{"problem" if line.plain.startswith("values:") else "err problem"}">{esc(line.plain)}</p>'
                   for line in problem_lines(view))


def compare_table(view: InspectView) -> str:
    rows = "".join(
        f'<tr><td class="l">{esc(e.name)}</td><td class="l">{esc(e.description)}</td><td>{e.mean_return:.4f}</td>'
        f'<td class="{"err" if e.differing_tokens else ""}">{e.differing_tokens} / {e.assistant_tokens}</td>'
        f"<td>{e.mean_abs_diff:.4f}</td></tr>" for e in view.stats.summaries())
    return (f"<h2>return estimators (gamma {view.stats.gamma:g}, assistant tokens of the whole file)</h2>"
            '<table class="compare"><tr><th class="l">estimator</th><th class="l">what it does</th><th>mean return</th>'
            "<th>tokens that differ from carry-through</th><th>mean |diff|</th></tr>" + rows + "</table>")


def filters(view: InspectView) -> str:
    finishes = sorted({t.finish_reason for t in view.trajectories})
    options = '<option value="">any</option>' + "".join(f'<option value="{esc(f)}">{esc(f)}</option>' for f in finishes)
    return ('<span class="filters"><label><input type="checkbox" id="f-failed"> failed only</label> '
            f'<label>finish <select id="f-finish">{options}</select></label> '
            '<label><input type="checkbox" id="f-tools"> tool errors</label> '
            '<label>reward ≥ <input type="number" id="f-min" step="any"></label> '
            '<label>≤ <input type="number" id="f-max" step="any"></label> <b id="f-count"></b></span>')


def page(title: str, header: str, body: str, data: dict) -> str:
    """The page around ``body``: styles, the header, the data block and the script."""
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{CSS}</style></head><body>"
        f"<header>{header}</header><main>{body}</main>"
        f'<div id="tip"></div><script type="application/json" id="data">{blob}</script>'
        f"<script>{SCRIPT}</script></body></html>"
    )


def render(view: InspectView, compare: bool = False) -> str:
    """The page of one file: the summary, then every kept episode (tokens, tools, chart)."""
    modes = [("span", "span"), ("ret", "return"), ("adv", "advantage")]
    if compare:
        modes += [("reset", "return, reset-at-observation"), ("ignore", "return, ignore-mask")]
    radios = "".join(f'<label><input type="radio" name="mode" value="{k}"{" checked" if k == "span" else ""}> {esc(label)}</label> '
                     for k, label in modes)
    keys = ('<span class="key" style="background:#a8e6a8"></span>assistant'
            '<span class="key" style="background:#e2e4e8"></span>observation')
    colorbar = ('<span id="colorbar"><span id="cb-name"></span><span id="cb-lo"></span>'
                '<span class="bar" title="white: 0"></span><span id="cb-hi"></span><span>(white: 0)</span></span>')
    header = (f"<h1>agent-loop inspect · {esc(view.source)}</h1><span>colour by: {radios}</span>{colorbar}"
              f"<span>{keys}</span><span>gamma {view.stats.gamma:g} ({esc(view.gamma_note)}) · returns "
              f"{esc(view.stats.estimator)} ({esc(view.estimator_note)})</span>"
              + (f"<span><b>{esc(view.trained_note)}</b></span>" if view.trained_note else "") + filters(view))
    warnings = "".join(f'<div class="card warn">warning: {esc(p)}</div>' for p in view.problems)
    rows = range(len(view.trajectories))
    episodes = "".join(episode(view, r) for r in rows) or '<div class="card warn">no episode matches the selection</div>'
    data = {"compare": compare, "names": NAMES, "rows": [row_data(view, r, compare) for r in rows]}
    return page(f"agent-loop inspect: {view.source}", header, warnings + overview(view, compare) + episodes, data)
