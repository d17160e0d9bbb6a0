// The chat page: streams a reply from /chat/send, Send becomes Stop, figures under each reply,
// the conversation kept in this browser's storage. Replies are shown as text while they stream
// and then as the HTML the server rendered (raw HTML dropped there); nothing a model wrote is
// ever put into the page as HTML by this script.
"use strict";
(function () {
  const KEY = "llmgw-chat";
  const $ = (id) => document.getElementById(id);
  const form = $("chat");
  if (!form) return;
  const csrf = document.querySelector('meta[name="llmgw-csrf"]').content;
  const log = $("log"), send = $("send"), status = $("status"), message = $("message");
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
      if (r.ok) body.innerHTML = (await r.json()).html;  // the server's HTML: raw HTML already dropped
    } catch (e) { /* it stays as text */ }
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

  function note() {
    const opt = $("model").selectedOptions[0];
    $("model-note").textContent = opt && opt.dataset.onDemand === "yes"
      ? "This model is not loaded: the first message loads it, which can take a while." : "";
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
    status.textContent = "waiting for the model…";
    const t0 = performance.now();
    let first = null, usage = null, stopped = false;
    try {
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
  $("new").addEventListener("click", () => { state = { turns: [] }; save(); redraw(); });
  $("model").addEventListener("change", note);
  redraw();
})();
