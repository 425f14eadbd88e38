// The eogp page: ask a query, list ranked hits, explain one. Plain DOM, no framework, no CDN.
// Every text from the index is set with textContent (documents are data, never markup).
"use strict";

const BOOKKEEPING = new Set(["id", "shard", "position", "num_tokens", "num_loss_tokens", "truncated",
  "content_sha256", "content_kind", "text", "rank", "score", "score_1bit", "direction", "modules"]);
const state = { mode: "text", info: null, lastQuery: null, selected: null };
const $ = (id) => document.getElementById(id);
// Scores as people read them: 4 significant digits, exponents only for very large or small values.
const fmt = (v) => (Math.abs(v) >= 1e-3 && Math.abs(v) < 1e5) || v === 0 ? Number(v.toPrecision(4)).toString()
                                                                         : v.toExponential(3);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

// -- the API -----------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, field, message) { super(message); this.status = status; this.field = field; }
}

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  const token = localStorage.getItem("eogp-token");
  if (token) headers.Authorization = `Bearer ${token}`;
  return headers;
}

async function api(path, body, retried = false) {
  const headers = authHeaders();
  let response;
  try {
    response = await fetch(path, body === undefined ? { headers } :
      { method: "POST", headers, body: JSON.stringify(body) });
  } catch (err) {
    throw new ApiError(0, null, `cannot reach the server (${err.message}); is eogp serve still running?`);
  }
  if (response.status === 401 && !retried) {
    const given = window.prompt("This server needs an access token (eogp serve --token):");
    if (given) { localStorage.setItem("eogp-token", given.trim()); return api(path, body, true); }
  }
  let data = null;
  try { data = await response.json(); } catch (_) { /* not JSON: reported below */ }
  if (!response.ok) {
    const error = data && data.error;
    throw new ApiError(response.status, error ? error.field : null,
      error ? error.message : `the server answered ${response.status} ${response.statusText}`);
  }
  return data;
}

// -- errors and status -------------------------------------------------------------------------
const FIELD_INPUTS = { where: "where", k: "k", text: "query-text", messages: "turns", direction: "direction",
                       top: "select-top", queries: "behaviour-text", aggregate: "aggregate", normalize: "normalize",
                       group_by: "group-by" };

function showError(err) {
  const box = $("error");
  box.replaceChildren(el("strong", { text: err.field ? `${err.field}: ` : "Error: " }),
                      document.createTextNode(err.message));
  box.hidden = false;
  const input = FIELD_INPUTS[(err.field || "").split(/[.[]/)[0]];
  if (input && $(input)) $(input).classList.add("invalid");
}

function clearError() {
  $("error").hidden = true;
  document.querySelectorAll(".invalid").forEach((node) => node.classList.remove("invalid"));
}

// -- the index header and the filter's column list ---------------------------------------------
async function loadInfo() {
  try {
    const info = await api("/v1/info");
    state.info = info;
    const model = String(info.model && info.model.name || "?").split("/").filter(Boolean).slice(-2).join("/");
    $("index-info").textContent = `${info.rows.toLocaleString()} documents · model ${model} · ` +
      `${info.modules.length} modules · ${info.bytes_per_example} bytes per document`;
    $("k").max = info.limits.max_k;
    // The user's own metadata first: it is what people filter on; bookkeeping columns after.
    const ordered = [...info.columns.filter((c) => !BOOKKEEPING.has(c.name)),
                     ...info.columns.filter((c) => BOOKKEEPING.has(c.name))];
    const chips = ordered.map((column) => {
      const chip = el("button", { type: "button", class: "chip", title: `${column.name}: ${column.type}` },
        el("span", { text: column.name }), el("span", { class: "type", text: column.type }));
      chip.addEventListener("click", () => insertColumn(column.name));
      return chip;
    });
    $("columns").replaceChildren(el("span", { class: "muted", text: "Columns: " }), ...chips);
    fillGroupBy(ordered);
  } catch (err) {
    $("index-info").textContent = "";
    showError(err);
  }
}

function insertColumn(name) {
  const input = $("where");
  const quoted = /^[A-Za-z_][A-Za-z0-9_]*$/.test(name) ? name : `\`${name}\``;
  const at = input.selectionStart ?? input.value.length;
  input.value = input.value.slice(0, at) + quoted + input.value.slice(input.selectionEnd ?? at);
  input.focus();
}

// -- text or chat ------------------------------------------------------------------------------
function setMode(mode) {
  state.mode = mode;
  document.querySelectorAll(".tab").forEach((tab) => tab.classList.toggle("active", tab.dataset.mode === mode));
  $("query-text").hidden = mode !== "text";
  $("chat-box").hidden = mode !== "chat";
  $("behaviour-box").hidden = mode !== "behaviour";
  if (mode === "chat" && !$("turns").children.length) { addTurn("user"); addTurn("assistant"); }
}

function addTurn(role) {
  const select = el("select", { class: "role" });
  for (const name of ["system", "user", "assistant"]) {
    const option = el("option", { value: name, text: name });
    if (name === role) option.selected = true;
    select.append(option);
  }
  const remove = el("button", { type: "button", class: "small", title: "remove this turn", text: "×" });
  const turn = el("div", { class: "turn" }, select, el("textarea", { rows: "2", class: "content" }), remove);
  remove.addEventListener("click", () => turn.remove());
  $("turns").append(turn);
}

function currentQuery() {
  if (state.mode === "text") return { text: $("query-text").value };
  if (state.mode === "behaviour") return behaviourQuery();
  const messages = [...document.querySelectorAll("#turns .turn")].map((turn) => ({
    role: turn.querySelector(".role").value, content: turn.querySelector(".content").value }));
  return { messages };
}

// -- searching ---------------------------------------------------------------------------------
async function search(event) {
  event.preventDefault();
  clearError();
  const query = currentQuery();
  const k = Number($("k").value);
  const body = { ...query, k: Number.isInteger(k) ? k : $("k").value, direction: $("direction").value,
                 by_module: true };
  const where = $("where").value.trim();
  if (where) body.where = where;
  if ($("normalize").value !== "none") body.normalize = $("normalize").value;
  if ($("group-by").value) body.group_by = $("group-by").value;
  // What is on the page answers the previous query: gone before this one is asked, so that
  // neither a failed search nor the new answer stands beside stale hits, groups or explanations.
  $("results").replaceChildren();
  $("groups").replaceChildren();
  clearDetail();
  $("status").textContent = "searching…";
  $("search").disabled = true;
  try {
    const answer = await api("/v1/query", body);
    state.lastQuery = query.queries !== undefined ? null : query.text !== undefined ? query.text : query.messages;
    $("status").textContent = `${answer.results.length} hits in ${Math.round(answer.took_ms)} ms`;
    renderGroups(answer.groups, body.group_by);
    renderResults(answer.results, body.direction);
  } catch (err) {
    $("status").textContent = "";
    showError(err);
  } finally {
    $("search").disabled = false;
  }
}

function clearDetail() {
  state.selected = null;
  $("detail").replaceChildren(el("p", { class: "muted placeholder",
    text: "Select a result to see its score by module and by token." }));
}

// A side lists only documents of its sign (the server's rule), so it may be short or empty.
const SIDES = {
  positive: { title: "Helps: training on these lowers the query's loss", none: "No documents help this query." },
  negative: { title: "Hurts: training on these raises the query's loss", none: "No documents hurt this query." },
};

function renderResults(rows, direction) {
  const container = $("results");
  container.replaceChildren();
  const top = Math.max(0, ...rows.map((row) => Math.abs(row.score))) || 1;
  const sides = direction === "both" ? ["positive", "negative"] : [direction];
  for (const side of sides) {
    const hits = rows.filter((row) => (row.direction || direction) === side);
    if (direction === "both") container.append(el("h2", { class: `side ${side}`, text: SIDES[side].title }));
    if (!hits.length) {
      container.append(el("p", { class: `muted none ${side}`, text: SIDES[side].none }));
      continue;
    }
    const list = el("ol", { class: "hits" });
    for (const row of hits) list.append(hitItem(row, top));
    container.append(list);
  }
}

function hitItem(row, top) {
  const sign = row.score >= 0 ? "pos" : "neg";
  const bar = el("div", { class: "bar" }, el("div", { class: `fill ${sign}`,
    style: `width:${(100 * Math.abs(row.score) / top).toFixed(1)}%` }));
  const meta = el("div", { class: "meta" });
  for (const [key, value] of Object.entries(row)) {
    if (!BOOKKEEPING.has(key)) meta.append(el("span", { class: "kv" }, el("b", { text: key }), ` ${value}`));
  }
  meta.append(el("span", { class: "muted", text: `${row.shard}:${row.position} · ${row.num_tokens} tokens` }));
  const item = el("li", { class: "hit", tabindex: "0", "data-id": row.id },
    el("div", { class: "head" }, el("span", { class: "rank", text: `#${row.rank}` }),
       el("span", { class: "id", text: row.id }),
       el("span", { class: `score ${sign}`, text: fmt(row.score) }),
       // A rescored hit (an index with a rescoring tier): its one-bit scan's score beside the tier's.
       row.score_1bit != null ? el("span", { class: "score-1bit muted", title: "the one-bit scan's score",
                                             text: `1-bit ${fmt(row.score_1bit)}` }) : null),
    bar, meta,
    row.text != null ? el("div", { class: "doc", text: row.text }) : null);
  const select = () => selectHit(row, item);
  item.addEventListener("click", select);
  item.addEventListener("keydown", (e) => { if (e.key === "Enter") select(); });
  return item;
}

// -- one hit: its modules and its tokens --------------------------------------------------------
function moduleBars(modules) {
  const entries = Object.entries(modules || {});
  const top = Math.max(...entries.map(([, v]) => Math.abs(v))) || 1;
  const list = el("div", { class: "modules" });
  for (const [name, value] of entries) {
    const width = (50 * Math.abs(value) / top).toFixed(1);
    const fill = el("div", { class: `fill ${value >= 0 ? "pos" : "neg"}`,
      style: value >= 0 ? `left:50%;width:${width}%` : `left:${(50 - width).toFixed(1)}%;width:${width}%` });
    list.append(el("div", { class: "module-bar" }, el("span", { class: "name", text: name, title: name }),
      el("div", { class: "axis" }, fill), el("span", { class: "value", text: fmt(value) })));
  }
  return list;
}

function tokenLine(tokens) {
  const top = Math.max(...tokens.map((t) => Math.abs(t.contribution))) || 1;
  const line = el("div", { class: "tokens" });
  for (const t of tokens) {
    const alpha = (0.85 * Math.abs(t.contribution) / top).toFixed(3);
    const color = t.contribution >= 0 ? `rgba(22,163,74,${alpha})` : `rgba(220,38,38,${alpha})`;
    line.append(el("span", { class: "tok", style: `background:${color}`, text: t.token,
                             title: fmt(t.contribution) }));
  }
  return line;
}

async function selectHit(row, item) {
  document.querySelectorAll(".hit.selected").forEach((node) => node.classList.remove("selected"));
  item.classList.add("selected");
  state.selected = row.id;
  const detail = $("detail");
  const tokens = el("div", { class: "explain" }, el("p", { class: "muted", text: "explaining…" }));
  detail.replaceChildren(
    el("h2", { text: row.id }),
    el("p", { class: "muted", text: `${row.direction ? row.direction + " · " : ""}rank ${row.rank} · score ` +
                                    fmt(row.score) +
                                    (row.score_1bit != null ? ` (rescored) · 1-bit score ${fmt(row.score_1bit)}` : "") }),
    el("h3", { text: "Score by module" }),
    row.modules ? moduleBars(row.modules) : el("p", { class: "muted", text: "(no per-module terms)" }),
    el("h3", { text: "Score by token" }),
    tokens);
  if (state.lastQuery === null) {
    tokens.replaceChildren(el("p", { class: "muted",
      text: "Token contributions are explained for one query at a time: ask one of the behaviour's prompts." }));
    return;
  }
  try {
    const why = await api("/v1/explain", { query: state.lastQuery, id: row.id });
    if (state.selected !== row.id) return;  // another hit was selected meanwhile
    tokens.replaceChildren(
      el("p", { class: "legend" }, el("span", { class: "swatch pos" }), " raises the score ",
         el("span", { class: "swatch neg" }), " lowers it"),
      el("h4", { text: "Document" }), tokenLine(why.train_tokens || []),
      el("h4", { text: "Query" }), tokenLine(why.query_tokens || []),
      el("p", { class: "muted", text: (why.score_1bit != null
        ? `rescored score ${fmt(Number(why.score))} (the tier's, as ranked); 1-bit score ${fmt(Number(why.score_1bit))}; `
        : `1-bit score ${fmt(Number(why.score))} (as ranked); `) +
        `unquantized projection ${fmt(Number(why.score_projected))}` }));
  } catch (err) {
    if (state.selected !== row.id) return;
    tokens.replaceChildren(el("div", { class: "error", text: `${err.field ? err.field + ": " : ""}${err.message}` }));
  }
}

// -- selection: the query's most helpful documents as a file (POST /v1/select) -----------------
async function downloadSelection() {
  clearError();
  const query = currentQuery();
  // A behaviour's prompts are the target set; a single query is a set of one.
  const queries = query.queries !== undefined ? query.queries : [query.text !== undefined ? query.text : query];
  const body = { queries, top: $("select-top").value.trim() };
  const where = $("where").value.trim();
  if (where) body.where = where;
  if ($("normalize").value !== "none") body.normalize = $("normalize").value;  // the scores shown: cosine or influence
  $("status").textContent = "selecting…";
  $("download-selection").disabled = true;
  try {
    const response = await fetch("/v1/select", { method: "POST", headers: authHeaders(), body: JSON.stringify(body) });
    if (!response.ok) {
      let error = null;
      try { error = (await response.json()).error; } catch (_) { /* not JSON */ }
      throw new ApiError(response.status, error ? error.field : null,
        error ? error.message : `the server answered ${response.status} ${response.statusText}`);
    }
    const blob = await response.blob();
    const lines = (await blob.text()).split("\n").filter((line) => line).length;
    const link = el("a", { href: URL.createObjectURL(blob), download: "selection.jsonl" });
    document.body.append(link);
    link.click();
    link.remove();
    $("status").textContent = `selection.jsonl: ${lines} documents`;
  } catch (err) {
    $("status").textContent = "";
    showError(err instanceof ApiError ? err : new ApiError(0, null, err.message));
  } finally {
    $("download-selection").disabled = false;
  }
}

// -- behaviours and roll-ups --------------------------------------------------------------------
// A behaviour: one prompt per line, answered as one measurement (the mean or summed loss).
function behaviourQuery() {
  const queries = $("behaviour-text").value.split("\n").map((line) => line.trim()).filter(Boolean);
  return { queries, aggregate: $("aggregate").value };
}

function fillGroupBy(columns) {
  const select = $("group-by");
  for (const column of columns) {
    if (column.name === "text" || column.name === "content_sha256") continue;  // one group per row
    select.append(el("option", { value: column.name, text: column.name }));
  }
}

// An SQL condition that selects one group's rows.
function groupCondition(column, value) {
  const name = /^[A-Za-z_][A-Za-z0-9_]*$/.test(column) ? column : `\`${column}\``;
  if (value === null) return `${name} IS NULL`;
  if (typeof value === "number" || typeof value === "boolean") return `${name} = ${value}`;
  return `${name} = '${String(value).replaceAll("'", "''")}'`;
}

function filterToGroup(column, value) {
  const condition = groupCondition(column, value);
  const where = $("where").value.trim();
  $("where").value = where && where !== condition ? `(${where}) AND ${condition}` : condition;
  $("group-by").value = "";
  $("query-form").requestSubmit();
}

const CHART_HEAD = 20;  // groups drawn from the top of the ranking
const CHART_TAIL = 5;   // and from its bottom (the most negative)

function renderGroups(groups, column) {
  const box = $("groups");
  box.replaceChildren();
  if (!groups || !column) return;
  const top = Math.max(...groups.map((g) => Math.abs(g.sum))) || 1;
  box.append(el("h2", { text: `Influence by ${column} (sum of scores; click a group to see its hits)` }));
  // Many groups (a column of ids or documents): the two ends of the ranking, the middle counted.
  const hidden = Math.max(0, groups.length - (CHART_HEAD + CHART_TAIL));
  const shown = hidden ? [...groups.slice(0, CHART_HEAD), null, ...groups.slice(-CHART_TAIL)] : groups;
  for (const group of shown) {
    if (group === null) {
      box.append(el("p", { class: "muted", text: `… ${hidden} more groups with sums in between` }));
      continue;
    }
    const width = (50 * Math.abs(group.sum) / top).toFixed(1);
    const fill = el("div", { class: `fill ${group.sum >= 0 ? "pos" : "neg"}`,
      style: group.sum >= 0 ? `left:50%;width:${width}%` : `left:${(50 - width).toFixed(1)}%;width:${width}%` });
    const label = group[column] === null ? "(none)" : String(group[column]);
    const bar = el("button", { type: "button", class: "group-bar", "data-group": label,
      title: `${group.rows} rows · mean ${fmt(group.mean)} · max ${fmt(group.max)} · ` +
             `${group.top_positive} in the top helpers, ${group.top_negative} in the top hurters · ` +
             `${(100 * group.share_positive).toFixed(1)}% of the positive influence` },
      el("span", { class: "name", text: label }), el("div", { class: "axis" }, fill),
      el("span", { class: "value", text: fmt(group.sum) }), el("span", { class: "rows", text: `${group.rows} rows` }));
    bar.addEventListener("click", () => filterToGroup(column, group[column]));
    box.append(bar);
  }
}

// -- wiring ------------------------------------------------------------------------------------
document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => setMode(tab.dataset.mode)));
$("add-turn").addEventListener("click", () => addTurn("user"));
$("query-form").addEventListener("submit", search);
$("download-selection").addEventListener("click", downloadSelection);
$("query-text").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("query-form").requestSubmit();
});
loadInfo();
