// The status page (StatusHtml): one document, no external assets, so that it works on a machine
// without internet. It only reads status.json; nothing on it can change the job.
#include "server/core/status_report.h"

namespace aloe::server {

const char* StatusHtml() {
  return R"html(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ALOE status</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
header{background:#1d3b2a;color:#fff;padding:10px 18px;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
header .big{font-size:22px;font-weight:600}
header .muted{color:#b9cbbf}
main{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:14px;padding:14px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 14px}
section.wide{grid-column:1/-1}
h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:3px 8px 3px 0;border-bottom:1px solid #eef0f3;white-space:nowrap}
#job td{white-space:normal;word-break:break-word}
td.n,th.n{text-align:right}
.state-training{color:#1a7f37}.state-waiting{color:#9a6700}.state-evaluating{color:#0969da}
.state-draining{color:#cf222e}
.bar{height:8px;border-radius:2px;display:inline-block}
.learned{background:#2da44e}.size{background:#8c959f}
svg text{font:11px system-ui,sans-serif;fill:#57606a}
.err{color:#cf222e}
</style></head>
<body>
<header><h1>ALOE</h1>
<span id="role" class="muted">connecting…</span>
<span>version <span id="version" class="big">–</span><span id="max-versions" class="muted"></span></span>
<span>held-out loss <span id="loss" class="big">–</span></span>
<span>perplexity <span id="perplexity" class="big">–</span></span>
<span>workers <span id="worker-count" class="big">–</span></span>
<span>checkpoint <span id="checkpoint">–</span></span>
<span id="updated" class="muted"></span></header>
<main>
<section><h2>Model version over time</h2><svg id="plot-version" width="100%" height="200" viewBox="0 0 560 200" data-points="0"></svg></section>
<section><h2>Held-out loss and perplexity over time</h2><svg id="plot-loss" width="100%" height="200" viewBox="0 0 560 200" data-points="0"></svg></section>
<section class="wide"><h2>Workers</h2><table id="workers"><thead><tr><th>id</th><th>name</th><th>identity</th><th>role</th><th>state</th>
<th class="n">steps/s</th><th class="n">tokens/s</th><th class="n">planned steps</th><th class="n">last push</th><th class="n">staleness</th>
<th class="n">pushes</th><th class="n">bytes received</th></tr></thead><tbody></tbody></table></section>
<section><h2>Job</h2><table id="job"><tbody></tbody></table></section>
<section><h2>Data shards: learned share vs size share</h2><table id="data-shards"><thead><tr><th>shard</th><th class="n">learned</th><th class="n">size</th><th></th><th class="n">p(next)</th></tr></thead><tbody></tbody></table></section>
<section><h2>Rejected pushes</h2><table id="rejections"><tbody></tbody></table></section>
<section id="shards-section"><h2>Shard processes</h2><table id="shard-processes"><thead><tr><th>process</th><th>address</th><th class="n" title="the version the coordinator has committed for each shard process to follow">committed version</th><th class="n" title="the version each shard process reports it has applied; behind the committed one while commits are on their way">applied version</th></tr></thead><tbody></tbody></table><table id="figures"><tbody></tbody></table></section>
</main>
<script>
"use strict";
function $(id){return document.getElementById(id);}
function esc(s){return String(s).replace(/[&<>"]/g,function(c){return {"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;"}[c];});}
function num(v,d){if(v===null||v===undefined)return "–";d=d===undefined?2:d;var f=Math.pow(10,d),x=Math.round(Number(v)*f)/f;
  if(x===0)x=0;return x.toLocaleString("en-US",{maximumFractionDigits:d});}
function bytes(v){if(!v)return "0 B";var u=["B","KB","MB","GB","TB"],i=0;while(v>=1000&&i<4){v/=1000;i++;}return v.toFixed(i?1:0)+" "+u[i];}
function age(s){if(s===null||s===undefined)return "never";if(s<60)return s.toFixed(1)+" s ago";if(s<3600)return (s/60).toFixed(1)+" min ago";return (s/3600).toFixed(1)+" h ago";}
function rows(id,html){$(id).querySelector("tbody").innerHTML=html;}
// A line plot of series [[x,y],...] (x in seconds before now) into svg `id`; `step` draws
// steps; series2 (optional) goes on a right-hand axis.
function plot(id,series,opts){
  var svg=$(id),W=560,H=200,L=48,R=opts.series2?48:12,T=10,B=26;
  var pts=series.slice();
  if(opts.extend&&pts.length)pts.push([0,pts[pts.length-1][1]]);
  svg.setAttribute("data-points",String(series.length));
  if(!pts.length){svg.innerHTML='<text x="'+W/2+'" y="'+H/2+'" text-anchor="middle">no data yet</text>';return;}
  var x0=Math.min.apply(null,pts.map(function(p){return p[0];}).concat([opts.x0||0])),x1=0;
  if(x1-x0<10)x0=x1-10;
  function range(ps){var lo=Math.min.apply(null,ps.map(function(p){return p[1];})),hi=Math.max.apply(null,ps.map(function(p){return p[1];}));
    if(hi-lo<1e-9){hi+=0.5;lo-=0.5;}var pad=(hi-lo)*0.06;return [lo>=0?Math.max(0,lo-pad):lo-pad,hi+pad];}
  var yr=range(pts);
  function sx(x){return L+(x-x0)/(x1-x0)*(W-L-R);}
  function sy(y,r){return T+(1-(y-r[0])/(r[1]-r[0]))*(H-T-B);}
  function path(ps,r,step){var d="";ps.forEach(function(p,i){var X=sx(p[0]).toFixed(1),Y=sy(p[1],r).toFixed(1);
    if(i===0)d+="M"+X+" "+Y;else if(step)d+="H"+X+"V"+Y;else d+="L"+X+" "+Y;});return d;}
  var g='<rect x="'+L+'" y="'+T+'" width="'+(W-L-R)+'" height="'+(H-T-B)+'" fill="#fbfcfd" stroke="#d0d7de"/>';
  for(var i=0;i<=4;i++){var y=yr[0]+(yr[1]-yr[0])*i/4;g+='<text x="'+(L-4)+'" y="'+(sy(y,yr)+4)+'" text-anchor="end">'+num(y,opts.digits)+'</text>';}
  for(i=0;i<=4;i++){var x=x0+(x1-x0)*i/4;g+='<text x="'+sx(x)+'" y="'+(H-8)+'" text-anchor="middle">'+(x===0?"now":Math.round(x)+" s")+'</text>';}
  g+='<path class="series" d="'+path(pts,yr,opts.step)+'" fill="none" stroke="'+opts.color+'" stroke-width="2"/>';
  if(opts.dots)series.forEach(function(p){g+='<circle cx="'+sx(p[0]).toFixed(1)+'" cy="'+sy(p[1],yr).toFixed(1)+'" r="2.5" fill="'+opts.color+'"/>';});
  if(opts.series2&&opts.series2.length){var y2=range(opts.series2);
    g+='<path class="series" d="'+path(opts.series2,y2,false)+'" fill="none" stroke="'+opts.color2+'" stroke-width="1.5" stroke-dasharray="4 3"/>';
    for(i=0;i<=4;i++){var v=y2[0]+(y2[1]-y2[0])*i/4;g+='<text x="'+(W-R+4)+'" y="'+(sy(v,y2)+4)+'">'+num(v,1)+'</text>';}}
  if(opts.legend)g+='<text x="'+(L+6)+'" y="'+(T+14)+'">'+opts.legend+'</text>';
  svg.innerHTML=g;
}
var polls=0;
function render(s){
  polls++;
  $("role").textContent=s.role+" · "+num(s.parameters,0)+" parameters"+(s.draining?" · draining":"")+(s.stopping?" · stopping":"");
  $("version").textContent=String(s.version);
  $("max-versions").textContent=s.max_versions?" / "+s.max_versions:"";
  var last=s.evals.length?s.evals[s.evals.length-1]:null;
  $("loss").textContent=last?last[1].toFixed(4):"–";
  $("loss").setAttribute("data-version",last?String(last[0]):"");
  $("perplexity").textContent=last?Math.exp(last[1]).toFixed(2):"–";
  $("worker-count").textContent=String(s.workers.length);
  $("checkpoint").textContent=s.checkpoint?("version "+s.checkpoint.version+", "+age(s.checkpoint.age)):"none yet";
  rows("job",s.job.map(function(kv){return "<tr><th>"+esc(kv[0])+"</th><td>"+esc(kv[1])+"</td></tr>";}).join(""));
  rows("workers",s.workers.map(function(w){
    return '<tr data-worker="'+esc(w.name)+'" data-id="'+w.id+'"><td>'+w.id+"</td><td>"+esc(w.name)+"</td><td>"+esc(w.identity||"anonymous")+"</td><td>"+w.role+
      '</td><td class="state state-'+w.state+'">'+w.state+'</td><td class="n steps-per-second">'+num(w.steps_per_second,2)+
      '</td><td class="n tokens-per-second">'+num(w.tokens_per_second,0)+'</td><td class="n planned-steps">'+(w.planned_steps||"–")+
      '</td><td class="n last-push">'+age(w.last_push_age)+'</td><td class="n staleness">'+w.staleness+'</td><td class="n pushes">'+w.pushes+
      '</td><td class="n bytes">'+bytes(w.received_bytes)+"</td></tr>";}).join("")||'<tr><td colspan="12">no live workers</td></tr>');
  rows("data-shards",s.data_shards.map(function(d){
    return '<tr data-shard="'+esc(d.name)+'"><td>'+esc(d.name)+'</td><td class="n learned-share">'+(100*d.learned_share).toFixed(1)+'%</td><td class="n size-share">'+
      (100*d.size_share).toFixed(1)+'%</td><td><span class="bar learned" style="width:'+(120*d.learned_share).toFixed(0)+'px"></span><br><span class="bar size" style="width:'+
      (120*d.size_share).toFixed(0)+'px"></span></td><td class="n">'+num(d.probability,3)+"</td></tr>";}).join(""));
  rows("rejections",s.rejections.map(function(r){return '<tr data-reason="'+esc(r[0])+'"><th>'+esc(r[0])+'</th><td class="n">'+num(r[1],0)+"</td></tr>";}).join(""));
  rows("shard-processes",s.shard_processes.map(function(p){return "<tr><td>"+p.index+"</td><td>"+esc(p.address||"away")+'</td><td class="n">'+p.version+'</td><td class="n">'+p.applied_version+"</td></tr>";}).join("")||'<tr><td colspan="4">parameters held in this process</td></tr>');
  rows("figures",s.figures.map(function(f){return "<tr><th>"+esc(f[0])+'</th><td class="n">'+num(f[1],0)+"</td></tr>";}).join(""));
  // Both plots span the same time.
  var x0=Math.min.apply(null,[0].concat(s.history.versions.map(function(v){return v[0];}),s.history.losses.map(function(l){return l[0];})));
  plot("plot-version",s.history.versions,{step:true,extend:true,color:"#1a7f37",digits:0,legend:"version",x0:x0});
  var losses=s.history.losses.map(function(l){return [l[0],l[2]];});
  plot("plot-loss",losses,{color:"#0969da",digits:3,dots:true,x0:x0,legend:"loss (solid, left) · perplexity (dashed, right)",
    series2:s.history.losses.map(function(l){return [l[0],Math.exp(l[2])];}),color2:"#bf3989"});
  $("updated").textContent="updated "+new Date(s.now*1000).toLocaleTimeString();
  document.body.setAttribute("data-polls",String(polls));
}
function poll(){
  fetch("status.json",{cache:"no-store"}).then(function(r){if(!r.ok)throw new Error(r.status);return r.json();})
    .then(render).catch(function(e){$("updated").innerHTML='<span class="err">server unreachable ('+esc(e.message)+")</span>";})
    .then(function(){setTimeout(poll,2000);});
}
poll();
</script></body></html>
)html";
}

}  // namespace aloe::server
