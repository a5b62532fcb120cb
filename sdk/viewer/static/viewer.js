// agentrl view: the page. Routes in the URL hash:
//   #/                    runs and evaluations, and the pick of two to compare
//   #/f/ID                a run (curves that update while it trains) or an eval (summary); its rollouts
//   #/f/ID/r/N            one rollout: reward and its parts, transcript, diffs, per-token view
//   #/compare/A/B         two evaluations side by side, task by task
// Everything from a rollout is hostile (model and sandbox output): it goes in as text, never as HTML.
"use strict";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const statusLine = document.getElementById("status");
let poller = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "onclick" || key === "oninput" || key === "onchange") node[key] = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
function esc(value) {
  return String(value === undefined || value === null ? "" : value).replace(/[&<>"']/g, c => ESCAPES[c]);
}

function fmt(value, digits = 4) {
  if (value === undefined || value === null) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return value.toFixed(digits);
}

async function api(path) {
  const response = await fetch(path, {cache: "no-store"});
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${path}: HTTP ${response.status}`);
  return body;
}

function setCrumbs(...parts) {
  crumbs.replaceChildren(...parts.flatMap(([label, href]) => [" / ", href ? el("a", {href}, label) : el("span", {}, label)]));
}

function stopPolling() {
  if (poller) clearInterval(poller);
  poller = null;
}

// ---- folder list -------------------------------------------------------------------------------------
async function showFolders() {
  setCrumbs();
  const {folders} = await api("/api/folders");
  const rows = folders.map(f => el("tr", {"data-folder": f.id},
    el("td", {}, el("a", {href: `#/f/${f.id}`}, f.name)), el("td", {}, f.kind), el("td", {}, f.env || ""),
    el("td", {}, f.model || ""),
    el("td", {}, f.kind === "run" ? `${f.steps}${f.max_steps ? " / " + f.max_steps : ""}` : ""),
    el("td", {}, f.rollouts), el("td", {class: "num"}, fmt(f.reward)),
    el("td", {}, f.finished ? "finished" : "running or stopped")));
  const pick = name => el("select", {id: name}, folders.map(f => el("option", {value: f.id}, `${f.name} (${f.kind})`)));
  const a = pick("compare-a"), b = pick("compare-b");
  if (folders.length > 1) b.value = folders[1].id;
  main.replaceChildren(
    el("h1", {}, "Runs and evaluations"),
    el("table", {class: "list", id: "folders"},
       el("thead", {}, el("tr", {}, ["name", "kind", "env", "model", "steps", "rollouts", "reward", "state"]
                                     .map(h => el("th", {}, h)))),
       el("tbody", {}, rows)),
    el("h2", {}, "Compare two evaluations"),
    el("p", {}, a, " against ", b, " ",
       el("button", {id: "compare-go", onclick: () => { location.hash = `#/compare/${a.value}/${b.value}`; }},
          "compare")));
}

// ---- one folder ----------------------------------------------------------------------------------------
const CHARTS = [
  {title: "Reward", series: rows => [{name: "mean ± std", points: pts(rows, "reward"),
    band: rows.filter(r => num(r.reward) && num(r.reward_std)).map(r => [r.step, r.reward - r.reward_std, r.reward + r.reward_std])}]},
  {title: "Held-out evaluation", series: rows => {
    const evals = rows.filter(r => num(r["eval/mean_reward"]));
    return [{name: "held-out mean reward (95% CI)", points: evals.map(r => [r["eval/step"], r["eval/mean_reward"]]),
             band: evals.filter(r => num(r["eval/mean_reward_low"]) && num(r["eval/mean_reward_high"]))
               .map(r => [r["eval/step"], r["eval/mean_reward_low"], r["eval/mean_reward_high"]])},
            ...[...new Set(evals.flatMap(r => Object.keys(r).filter(k => k.startsWith("eval/pass@"))))].sort()
              .map(key => ({name: key.slice(5), points: evals.filter(r => num(r[key])).map(r => [r["eval/step"], r[key]])}))];
  }},
  {title: "Mismatch KL", series: rows => [{name: "KL(inference || trainer)", points: pts(rows, "mismatch_kl")}]},
  {title: "Staleness", series: rows => {
    const levels = [...new Set(rows.flatMap(r => Object.keys(r.staleness || {})))].sort();
    return levels.map(level => ({name: `${level} behind`,
                                 points: rows.map(r => [r.step, Number((r.staleness || {})[level] || 0)])}));
  }},
  {title: "Tokens/s", series: rows => [{name: "completion tokens/s", points: pts(rows, "tokens_per_s")}]},
  {title: "Step time split (s)", series: rows => [["step", "step_time_s"], ["wait", "wait_s"],
    ["train", "train_s"], ["stage", "weight_stage_s"], ["push", "weight_push_s"]]
    .map(([name, key]) => ({name, points: pts(rows, key)}))},
  {title: "Rollout time split (s, mean per rollout)", series: rows => [["rollout", "rollout_s"],
    ["generation", "rollout_generation_s"], ["sandbox", "rollout_sandbox_s"]]
    .map(([name, key]) => ({name, points: pts(rows, key)}))},
  {title: "Tool calls", series: rows => [["calls per rollout", "tool_calls_per_rollout"],
    ["rollouts without a call", "rollouts_without_tool_calls"], ["parse failures", "tool_call_parse_failures"]]
    .map(([name, key]) => ({name, points: pts(rows, key)}))},
  {title: "Dropped groups", series: rows => [{name: "dropped (stale)", points: pts(rows, "dropped_stale")},
    {name: "rollout errors", points: pts(rows, "rollout_errors")}]},
];
const num = v => typeof v === "number" && isFinite(v);
const pts = (rows, key) => rows.filter(r => num(r[key])).map(r => [r.step, r[key]]);

async function showFolder(id) {
  const info = await api(`/api/folders/${id}`);
  setCrumbs([info.name, `#/f/${id}`]);
  const head = el("div", {class: "folder-head"}, el("h1", {}, info.name),
                  el("p", {class: "muted"}, `${info.kind} · ${info.path}`));
  const charts = el("div", {class: "charts", id: "charts"});
  const browser = el("section", {id: "rollouts"});
  main.replaceChildren(head);
  if (info.kind === "run") main.append(el("h2", {}, "Curves"), charts);
  else main.append(summaryTable(info.summary));
  main.append(el("h2", {}, "Rollouts"), browser);
  const state = {rows: [], next: 0, total: -1};
  const refreshCharts = async () => {
    const page = await api(`/api/folders/${id}/metrics?since=${state.next}`);
    if (page.rows.length || state.next === 0) {
      state.rows = state.rows.concat(page.rows);
      state.next = page.next;
      charts.replaceChildren(...CHARTS.map(chart => {
        const box = el("div", {class: "chart-box"});
        drawChart(box, {title: chart.title, series: chart.series(state.rows)});
        return box;
      }));
    }
  };
  const filters = rolloutFilters(id, browser);
  if (info.kind === "run") await refreshCharts();
  await filters.load();
  poller = setInterval(async () => {
    try {
      if (info.kind === "run") await refreshCharts();
      await filters.load({quiet: true});
      statusLine.textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (error) { statusLine.textContent = String(error); }
  }, 3000);
}

function summaryTable(summary) {
  if (!summary) return el("p", {class: "muted"}, "no summary.json yet (the evaluation is running or stopped)");
  const rows = [["mean reward", `${fmt(summary.mean_reward)} ± ${fmt(summary.std_reward)}`],
                [`avg@${summary.rollouts_per_task}`, fmt(summary.avg_at_k)],
                ...Object.entries(summary.pass_at_k || {}).map(([k, v]) => [`pass@${k}`, fmt(v)]),
                ...Object.entries(summary.metrics || {}).map(([k, v]) => [`metric ${k}`, fmt(v)]),
                ["rollouts (errors, truncated)", `${summary.num_rollouts} (${summary.errors}, ${summary.truncated})`],
                ["completion tokens/s", fmt(summary.completion_tokens_per_s, 1)]];
  return el("table", {class: "kv", id: "summary"}, el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))));
}

function rolloutFilters(id, box) {
  const step = el("select", {id: "f-step"}, el("option", {value: ""}, "all steps"));
  const task = el("input", {id: "f-task", placeholder: "task, id or prompt text", size: 24});
  const minReward = el("input", {id: "f-min", placeholder: "min", size: 5});
  const maxReward = el("input", {id: "f-max", placeholder: "max", size: 5});
  const count = el("span", {class: "muted", id: "f-count"});
  const table = el("div", {id: "rollout-list"});
  const PAGE = 1000;
  let offset = 0;
  const previous = el("button", {id: "f-prev", onclick: () => { offset = Math.max(0, offset - PAGE); load(); }}, "◀ previous");
  const next = el("button", {id: "f-next", onclick: () => { offset += PAGE; load(); }}, "next ▶");
  let lastKey = "";
  let timer = null;
  const load = async ({quiet} = {}) => {
    const query = new URLSearchParams({limit: String(PAGE), offset: String(offset)});
    if (step.value !== "") query.set("step", step.value);
    if (task.value.trim()) query.set("task", task.value.trim());
    if (minReward.value.trim()) query.set("min_reward", minReward.value.trim());
    if (maxReward.value.trim()) query.set("max_reward", maxReward.value.trim());
    let page;
    try { page = await api(`/api/folders/${id}/rollouts?${query}`); }
    catch (error) { count.textContent = String(error); return; }
    const key = `${query}|${page.total}`;
    if (quiet && key === lastKey) return;
    lastKey = key;
    const known = new Set([...step.options].map(o => o.value));
    for (const s of page.steps) if (!known.has(String(s))) step.append(el("option", {value: s}, `step ${s}`));
    const shown = page.rows.length ? `, ${offset + 1}-${offset + page.rows.length} shown` : "";
    count.textContent = `${page.matched} of ${page.total} rollouts${page.matched > page.rows.length ? shown : ""}`;
    previous.disabled = offset === 0;
    next.disabled = offset + page.rows.length >= page.matched;
    table.innerHTML = rolloutTable(id, page.rows);
  };
  const later = () => { clearTimeout(timer); timer = setTimeout(() => { offset = 0; load(); }, 250); };
  step.onchange = () => { offset = 0; load(); };
  for (const input of [task, minReward, maxReward]) input.oninput = later;
  box.replaceChildren(el("div", {class: "filters"}, step, " ", task, " reward ", minReward, " to ", maxReward, " ", count,
                         previous, next), table);
  return {load};
}

// One string for the whole table: 1,000 rows in one parse, every value escaped.
function rolloutTable(id, rows) {
  const head = "<table class='list rollouts'><thead><tr><th>#</th><th>step</th><th>task</th><th>prompt</th>" +
               "<th>answer</th><th>reward</th><th>advantage</th><th>turns</th><th>tokens</th><th>tools</th><th></th></tr></thead><tbody>";
  const body = rows.map(r => `<tr data-n="${esc(r.n)}"><td><a href="#/f/${esc(id)}/r/${esc(r.n)}">${esc(r.n)}</a></td>` +
    `<td>${esc(r.step ?? "")}</td><td>${esc(r.example_id ?? r.task)}</td><td class="text">${esc(r.prompt)}</td>` +
    `<td class="text">${esc(r.answer)}</td><td class="num">${esc(fmt(r.reward))}</td><td class="num">${esc(fmt(r.advantage))}</td>` +
    `<td>${esc(r.turns)}</td><td>${esc(r.completion_tokens)}</td><td>${esc(r.tool_calls)}</td>` +
    `<td class="err">${r.error ? esc(r.error) : r.truncated ? "truncated" : ""}</td></tr>`).join("");
  return head + body + "</tbody></table>";
}

// ---- one rollout ---------------------------------------------------------------------------------------
async function showRollout(id, n) {
  const [info, data] = await Promise.all([api(`/api/folders/${id}`), api(`/api/folders/${id}/rollouts/${n}`)]);
  setCrumbs([info.name, `#/f/${id}`], [`rollout ${n}`, `#/f/${id}/r/${n}`]);
  const record = data.record;
  main.replaceChildren(
    el("h1", {}, `Rollout ${n}`, record.step !== undefined ? ` · step ${record.step}` : ""),
    el("div", {class: "rollout"},
       el("section", {class: "transcript", id: "transcript"}, el("h2", {}, "Transcript"), transcript(record)),
       el("aside", {}, rewardPanel(record), stateBlock(record))),
    el("h2", {}, "Tokens"), tokenView(data, info.kind));
}

function rewardPanel(record) {
  const rows = [["reward", record.reward], ...Object.entries(record.metrics || {}).map(([k, v]) => [k, v])];
  if (record.advantage !== undefined) rows.push(["advantage", record.advantage]);
  const extra = [["task", `${record.task?.task ?? ""} ${record.task?.example_id ?? ""}`],
                 ...((record.policy_versions || []).length ? [["policy versions", record.policy_versions.join(", ")]] : []),
                 ["truncated", record.truncated ? "yes" : "no"], ["elapsed", `${fmt(record.elapsed_s, 2)} s`]];
  return el("div", {class: "reward", id: "reward"},
    el("div", {class: "reward-value"}, "reward ", el("strong", {}, fmt(record.reward))),
    el("table", {class: "kv"}, el("tbody", {},
       rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {class: "num"}, fmt(v)))),
       extra.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))))),
    record.error ? el("pre", {class: "error"}, record.error) : null,
    record.task?.answer ? el("div", {}, el("h3", {}, "reference answer"), el("pre", {}, record.task.answer)) : null);
}

function looksLikeDiff(text) {
  return typeof text === "string" && (/^diff --git /m.test(text) || (/^--- /m.test(text) && /^\+\+\+ /m.test(text) && /^@@ /m.test(text)));
}

function diffBlock(text) {
  const pre = el("pre", {class: "diff"});
  for (const line of text.split("\n")) {
    const kind = line.startsWith("+++") || line.startsWith("---") ? "file" : line.startsWith("@@") ? "hunk" :
                 line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : line.startsWith("diff ") ? "file" : "ctx";
    pre.append(el("span", {class: `diff-${kind}`}, line + "\n"));
  }
  return pre;
}

function textBlock(text) {
  return looksLikeDiff(text) ? diffBlock(text) : el("pre", {}, text);
}

function transcript(record) {
  const messages = record.messages || [];
  if (!messages.length) return el("p", {class: "muted"}, "no messages");
  return el("div", {}, messages.map(message => el("div", {class: `msg role-${message.role}`},
    el("div", {class: "role"}, message.role, message.name ? ` · ${message.name}` : "",
       message.tool_call_id ? ` · answers ${message.tool_call_id}` : ""),
    message.content ? textBlock(message.content) : null,
    (message.tool_calls || []).map(call => el("div", {class: "toolcall"},
      el("span", {class: "toolname"}, `${call.function.name}`), " ", el("span", {class: "muted"}, call.id),
      textBlock(prettyArguments(call.function.arguments)))))));
}

function prettyArguments(text) {
  try {
    const value = JSON.parse(text);
    const strings = Object.values(value).filter(v => typeof v === "string");
    const diff = strings.find(looksLikeDiff);
    return diff || JSON.stringify(value, null, 2);
  } catch { return text; }
}

function stateBlock(record) {
  const entries = Object.entries(record.state || {});
  if (!entries.length) return null;
  return el("div", {class: "state", id: "state"}, el("h3", {}, "environment state"),
    entries.map(([key, value]) => el("div", {}, el("div", {class: "role"}, key),
      textBlock(typeof value === "string" ? value : JSON.stringify(value, null, 2)))));
}

const MODES = {
  logprob: {label: "inference logprob", color: t => t.logprob === null ? null : `rgba(220, 38, 38, ${Math.min(1, -t.logprob / 3)})`},
  mismatch: {label: "trainer − inference", color: t => t.mismatch === null ? null : `rgba(124, 58, 237, ${Math.min(1, Math.abs(t.mismatch) / 0.5)})`},
  mask: {label: "loss mask", color: t => t.loss ? "rgba(37, 99, 235, 0.35)" : null},
};

function tokenView(data, kind) {
  const tokens = data.tokens || [];
  const box = el("section", {id: "tokens", class: "tokens"});
  if (!tokens.length) { box.append(el("p", {class: "muted"}, "no token data in this record")); return box; }
  const hasTrainer = tokens.some(t => t.trainer_logprob !== null);
  const spans = tokens.map(t => {
    const text = t.text === null ? `⟨${t.id}⟩` : t.text.replace(/\n/g, "↵\n");
    const span = el("span", {class: t.loss ? "tok loss" : "tok", title:
      `id ${t.id}${t.loss ? "" : " · not trained (prompt or environment)"}` +
      (t.logprob !== null ? ` · logprob ${fmt(t.logprob)}` : "") +
      (t.trainer_logprob !== null ? ` · trainer ${fmt(t.trainer_logprob)} · Δ ${fmt(t.mismatch)}` : "") +
      (t.version !== null ? ` · policy v${t.version}` : "")}, text);
    return [span, t];
  });
  const note = el("span", {class: "muted", id: "token-note"});
  const paint = mode => {
    for (const [span, t] of spans) span.style.backgroundColor = MODES[mode].color(t) || "";
    for (const button of buttons) button.classList.toggle("active", button.dataset.mode === mode);
    note.textContent = mode === "mismatch" && !hasTrainer ?
      "this record carries no trainer logprobs: the run's mismatch KL per step is on its curves" :
      mode === "logprob" ? "darker red: less likely under the inference policy; grey text: not trained on" : "";
  };
  // An evaluation has no trainer: no "trainer − inference" colouring (a run's rollouts get it, or a note why not)
  const buttons = Object.entries(MODES).filter(([mode]) => mode !== "mismatch" || kind !== "eval").map(([mode, {label}]) => {
    const button = el("button", {"data-mode": mode, onclick: () => paint(mode)}, label);
    button.dataset.mode = mode;
    return button;
  });
  const loss = tokens.filter(t => t.loss).length;
  box.append(el("div", {class: "filters"}, "colour by ", buttons, " ", note),
             el("p", {class: "muted"}, `${tokens.length} tokens, ${loss} trained on` + (data.decoded ? "" : " (no tokenizer here: ids shown)")),
             el("div", {class: "token-text"}, spans.map(([span]) => span)));
  paint("logprob");
  return box;
}

// ---- two evaluations -----------------------------------------------------------------------------------
async function showCompare(a, b) {
  let data = await api(`/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  // `agentrl eval --model RUN/checkpoints/step_N` writes the base model's evaluation beside it as NAME-baseline:
  // the base is the reference (A) and the delta reads "checkpoint minus base", green where the checkpoint is better.
  if (data.b.name.endsWith("-baseline") && !data.a.name.endsWith("-baseline")) {
    location.replace(`#/compare/${b}/${a}`);
    return;
  }
  setCrumbs([`compare ${data.a.name} / ${data.b.name}`, `#/compare/${a}/${b}`]);
  const detail = el("section", {id: "compare-detail"});
  const tasks = data.tasks.map(task => ({...task,
    delta: task.a_reward !== null && task.b_reward !== null ? task.b_reward - task.a_reward : null}));
  const paired = tasks.filter(task => task.delta !== null);
  const mean = values => values.length ? values.reduce((x, y) => x + y, 0) / values.length : null;
  const better = paired.filter(task => task.delta > 0).length, worse = paired.filter(task => task.delta < 0).length;
  const deltaCell = delta => el("td", {class: delta > 0 ? "num up" : delta < 0 ? "num down" : "num"},
                                delta === null ? "" : (delta > 0 ? "+" : "") + fmt(delta));
  const columns = [["task", t => t.prompt], ["A reward", t => t.a_reward], ["B reward", t => t.b_reward],
                   ["B − A", t => t.delta]];
  let order = {column: 3, descending: false};
  const body = el("tbody", {});
  const fill = () => {
    const [, key] = columns[order.column];
    const sorted = tasks.slice().sort((x, y) => {
      const [p, q] = [key(x), key(y)];
      if (p === null || q === null) return p === null ? 1 : -1;
      return (p < q ? -1 : p > q ? 1 : 0) * (order.descending ? -1 : 1);
    });
    body.replaceChildren(...sorted.map(task => el("tr", {class: "clickable", "data-task": task.task_key,
        onclick: () => showCompareTask(data, task, detail, true)},
      el("td", {class: "text"}, task.prompt), el("td", {class: "num"}, fmt(task.a_reward)),
      el("td", {class: "num"}, fmt(task.b_reward)), deltaCell(task.delta))));
  };
  const header = columns.map(([label], index) => el("th", {class: "sortable", "data-column": String(index),
    title: "sort by this column", onclick: () => {
      order = {column: index, descending: order.column === index ? !order.descending : index !== 0};
      fill();
    }}, label));
  const summary = el("tr", {class: "summary", id: "compare-summary"}, el("th", {},
      `mean over ${paired.length} tasks (B better on ${better}, worse on ${worse})`),
    el("td", {class: "num"}, fmt(mean(paired.map(t => t.a_reward)))),
    el("td", {class: "num"}, fmt(mean(paired.map(t => t.b_reward)))), deltaCell(mean(paired.map(t => t.delta))));
  fill();
  main.replaceChildren(
    el("h1", {}, "Two evaluations, task by task"),
    el("p", {}, el("strong", {}, "A: "), data.a.name, ` (${data.a.model || ""}, mean reward ${fmt(data.a.reward)})`, el("br"),
       el("strong", {}, "B: "), data.b.name, ` (${data.b.model || ""}, mean reward ${fmt(data.b.reward)})`),
    el("p", {class: "muted"}, `${data.tasks.length} tasks in both; ${data.only_a} only in A, ${data.only_b} only in B. ` +
       "B − A is green where B scored higher. Click a column to sort, a task to open it."),
    el("table", {class: "list", id: "compare-tasks"}, el("thead", {}, el("tr", {}, header), summary), body),
    detail);
  if (data.tasks.length) await showCompareTask(data, data.tasks[0], detail, false);
}

async function showCompareTask(data, task, detail, scroll) {
  const side = async (folder, summaries, label) => {
    const records = await Promise.all(summaries.map(s => api(`/api/folders/${folder.id}/rollouts/${s.n}`)));
    return el("div", {class: "side", "data-side": label}, el("h3", {}, `${label}: ${folder.name}`),
      records.map(({n, record}) => el("div", {class: "side-rollout"},
        el("div", {class: "reward-value"}, el("a", {href: `#/f/${folder.id}/r/${n}`}, `rollout ${n}`), " · reward ", el("strong", {}, fmt(record.reward)),
           " ", el("span", {class: "muted"}, Object.entries(record.metrics || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(" · "))),
        transcript({messages: (record.messages || []).filter(m => m.role !== "system")}))));
  };
  const [left, right] = await Promise.all([side(data.a, task.a, "A"), side(data.b, task.b, "B")]);
  detail.replaceChildren(el("h2", {}, "Task"), el("pre", {}, task.prompt), el("div", {class: "side-by-side"}, left, right));
  if (scroll) detail.scrollIntoView({block: "start"});
}

// ---- routing -------------------------------------------------------------------------------------------
async function route() {
  stopPolling();
  statusLine.textContent = "";
  document.body.dataset.ready = "";
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  try {
    if (parts[0] === "f" && parts.length === 2) await showFolder(parts[1]);
    else if (parts[0] === "f" && parts[2] === "r") await showRollout(parts[1], parts[3]);
    else if (parts[0] === "compare") await showCompare(parts[1], parts[2]);
    else await showFolders();
    document.body.dataset.readyMs = String(Math.round(performance.now()));  // since navigation start
    document.body.dataset.ready = location.hash || "#/";
  } catch (error) {
    main.replaceChildren(el("p", {class: "error", id: "error"}, String(error.message || error)));
    document.body.dataset.ready = "error";
  }
}

window.addEventListener("hashchange", route);
route();
