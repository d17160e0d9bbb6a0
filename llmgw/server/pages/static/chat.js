// The chat page: streams a reply from /chat/send, Send becomes Stop, figures under each reply,
// the conversation kept in this browser's storage. Replies are shown as text while they stream
// and then as the HTML the server rendered (raw HTML dropped there); nothing a model wrote is
// ever put into the page as HTML by this script; maths in it is typeset with KaTeX. An on-demand model that is not loaded is woken
// first (/chat/wake), polled every second (/chat/model-status) with its state in the status line,
// and the message is sent once it serves.
"use strict";
(function () {
  const KEY = "llmgw-chat";
  const $ = (id) => document.getElementById(id);
  const form = $("chat");
  if (!form) return;
  const csrf = document.querySelector('meta[name="llmgw-csrf"]').content;
  const log = $("log"), send = $("send"), status = $("status"), message = $("message"), bar = $("loading-bar");
  const POLL_MS = 1000;  // model-status, while a model loads
  const REWAKE_MS = 30000;  // asked for again this often while waiting, so a long download is not idled out
  let state = load();
  let controller = null;

  function load() {
    try { return JSON.parse(localStorage.getItem(KEY)) || { turns: [] }; } catch (e) { return { turns: [] }; }
  }
  function save() { localStorage.setItem(KEY, JSON.stringify(state)); }

  function figures(f) {
    if (!f) return "";
    const parts = [];
    if (f.tokens != null) parts.push(f.tokens + " tokens");
    if (f.tps != null) parts.push(f.tps.toFixed(1) + " tokens/s");
    if (f.ttft != null) parts.push("first token " + latency(f.ttft));
    if (f.total != null) parts.push("total " + latency(f.total));
    if (f.stopped) parts.push("stopped");
    return parts.join(" · ");
  }
  function latency(s) {
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(1) + " s";
    return Math.floor(s / 60) + "m " + Math.round(s % 60) + "s";
  }

  function turnBox(turn) {
    const box = document.createElement("div");
    box.className = "turn " + turn.role;
    const body = document.createElement("div");
    body.className = turn.role === "assistant" ? "reply" : "asked";
    body.textContent = turn.content;
    box.appendChild(body);
    const fig = document.createElement("div");
    fig.className = "figures";
    fig.textContent = figures(turn.figures);
    box.appendChild(fig);
    log.appendChild(box);
    return { box, body, fig };
  }

  async function rendered(body, text) {
    try {
      const r = await fetch("/chat/render", {
        method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({ text }),
      });
      if (r.ok) {
        body.innerHTML = (await r.json()).html;  // the server's HTML: raw HTML already dropped
        typeset(body);
      }
    } catch (e) { /* it stays as text */ }
  }

  // The maths the server set aside (.math, its TeX as text) typeset by the vendored KaTeX as MathML:
  // no fonts and no inline styles, which the pages' Content-Security-Policy would refuse. KaTeX's
  // defaults keep \href and the like off (trust: false), so maths cannot carry a link.
  function typeset(el) {
    if (typeof katex === "undefined") return;
    for (const m of el.querySelectorAll(".math")) {
      try {
        katex.render(m.textContent, m, { displayMode: m.classList.contains("display"), output: "mathml", throwOnError: false });
      } catch (e) { /* it stays as TeX */ }
    }
  }

  function redraw() {
    log.textContent = "";
    for (const t of state.turns) {
      const v = turnBox(t);
      if (t.role === "assistant" && t.content) rendered(v.body, t.content);
    }
    if (state.system != null) $("system").value = state.system;
    if (state.temperature != null) $("temperature").value = state.temperature;
    if (state.model) $("model").value = state.model;
    if (state.project != null && $("project")) $("project").value = state.project;
    note();
  }

  function option(model) { return Array.from($("model").options).find((o) => o.value === model); }
  function onDemand(model) {
    const opt = option(model);
    return !!opt && opt.dataset.onDemand === "yes";
  }
  // The picker's "(not loaded)" follows what the model-status says.
  function loaded(model, yes) {
    const opt = option(model);
    if (opt) opt.textContent = model + (yes ? "" : " (not loaded)");
  }

  async function note() {
    const model = $("model").value;
    const el = $("model-note");
    if (!onDemand(model)) { el.textContent = ""; return; }
    el.textContent = "This model is not loaded: the first message loads it, which can take a while.";
    try {
      const st = await loading("/chat/model-status?" + query(model, $("project") ? $("project").value : ""));
      loaded(model, st.state === "ready");
      if ($("model").value !== model) return;  // another model was chosen meanwhile
      if (st.state === "ready") el.textContent = "This model is loaded (on demand: it stops after a while unused).";
      else if (st.state !== "waiting for a node") el.textContent = st.message;
    } catch (e) {
      if ($("model").value === model) el.textContent = e.message;
    }
  }

  function query(model, project) { return new URLSearchParams({ model, project: project || "" }).toString(); }

  // /chat/wake and /chat/model-status answer the model's state, or an error with its sentence.
  async function loading(url, opts) {
    const r = await fetch(url, opts);
    let body = null;
    try { body = await r.json(); } catch (e) { /* said below */ }
    if (!r.ok || !body || !body.state) {
      throw new Error(body && body.error ? body.error.message : "the gateway answered " + r.status);
    }
    return body;
  }

  function pause(ms, signal) {
    return new Promise((resolve, reject) => {
      const t = setTimeout(resolve, ms);
      signal.addEventListener("abort", () => { clearTimeout(t); reject(new DOMException("stopped", "AbortError")); },
        { once: true });
    });
  }

  function showLoading(st) {
    status.textContent = st.message;
    status.dataset.state = st.state;
    const downloading = st.state === "downloading" && st.percent != null;
    bar.hidden = !downloading;
    if (downloading) bar.value = st.percent;
  }

  // Wake the model and wait, polling, until it serves; throws its failure (or AbortError on Stop).
  async function wake(model, project, signal) {
    const askFor = () => loading("/chat/wake", {
      method: "POST", signal, headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
      body: JSON.stringify({ model, project: project || null }),
    });
    let st = await askFor();
    let asked = performance.now();
    try {
      while (st.state !== "ready") {
        showLoading(st);
        if (st.state === "failed") throw new Error(st.message);
        await pause(POLL_MS, signal);
        if (performance.now() - asked >= REWAKE_MS) { st = await askFor(); asked = performance.now(); }
        else st = await loading("/chat/model-status?" + query(model, project), { signal });
      }
    } finally {
      bar.hidden = true;
      if (st.state !== "failed") delete status.dataset.state;  // a failure stays marked in the status line
    }
    if ($("model").value === model) note();
  }

  async function ask(text) {
    state.model = $("model").value;
    state.system = $("system").value;
    state.temperature = parseFloat($("temperature").value);
    state.project = $("project") ? $("project").value : "";
    state.turns.push({ role: "user", content: text });
    turnBox(state.turns[state.turns.length - 1]);
    const reply = { role: "assistant", content: "", figures: {} };
    const view = turnBox(reply);
    save();
    controller = new AbortController();
    send.textContent = "Stop";
    delete status.dataset.state;
    let t0 = performance.now();
    let first = null, usage = null, stopped = false;
    try {
      if (onDemand(state.model)) {
        await wake(state.model, state.project, controller.signal);
        t0 = performance.now();  // the reply's figures count from here, not from the load
      }
      status.textContent = "waiting for the model…";
      const r = await fetch("/chat/send", {
        method: "POST", signal: controller.signal,
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({
          model: state.model, project: state.project || null, system: state.system,
          temperature: state.temperature,
          messages: state.turns.filter((t) => t !== reply).map((t) => ({ role: t.role, content: t.content })),
        }),
      });
      if (!r.ok) {
        let msg = "the gateway answered " + r.status;
        try { msg = (await r.json()).error.message; } catch (e) { /* keep the status */ }
        throw new Error(msg);
      }
      status.textContent = "";
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, i).trim();
          buf = buf.slice(i + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          let ev;
          try { ev = JSON.parse(data); } catch (e) { continue; }
          if (ev.error) throw new Error(ev.error.message || "the engine failed");
          if (ev.usage) usage = ev.usage;
          const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
          if (delta && delta.content) {
            if (first === null) first = performance.now();
            reply.content += delta.content;
            view.body.textContent = reply.content;
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") { stopped = true; }
      else { status.textContent = e.message; }
    } finally {
      controller = null;
      send.textContent = "Send";
    }
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    reply.figures = {
      tokens, stopped,
      ttft: first === null ? null : (first - t0) / 1000,
      total: (end - t0) / 1000,
      tps: tokens && first !== null && end > first ? tokens / ((end - first) / 1000) : null,
    };
    view.fig.textContent = figures(reply.figures);
    state.turns.push(reply);
    save();
    if (reply.content) rendered(view.body, reply.content);
  }

  // Stop: on the click itself, before the browser checks the (now empty, required) message field.
  send.addEventListener("click", (ev) => {
    if (controller) { ev.preventDefault(); controller.abort(); }
  });
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (controller) return;
    const text = message.value.trim();
    if (!text) return;
    message.value = "";
    ask(text);
  });
  $("new").addEventListener("click", (ev) => { ev.preventDefault(); state = { turns: [] }; save(); redraw(); });
  $("model").addEventListener("change", note);
  if ($("project")) $("project").addEventListener("change", note);
  redraw();
})();
