// The fabric map (/admin/fabrics). The drawing is the server's SVG, readable without script; this adds
// zoom and pan on its viewBox (the wheel, dragging, the + − Fit buttons), fading what a mark does not
// connect while it is pointed at, a panel with a clicked mark's details, and the find box and the
// colour pills acting in place. The map is swapped by htmx every fifteen seconds, so what is changed
// here (the view, the node found, the colouring, the mark chosen) is kept and put back after each swap.
// Events are listened for on the document, so the swapped drawing needs no wiring of its own.
"use strict";

(() => {
  const MAX_ZOOM = 40;
  const MARKS = ".sw, .ad, .cable, .node-label";
  const state = { view: null, find: null, byRail: null, selected: null };
  let cablesOf = null; // element id -> the cables ending there, built once per drawing
  let drag = null;
  let hovered = null; // the mark pointed at, whose connections are lit

  const svg = () => document.getElementById("fabric-svg");
  const numbers = (text) => text.trim().split(/\s+/).map(Number);
  const full = (s) => numbers(s.dataset.full);
  const current = (s) => numbers(s.getAttribute("viewBox"));

  function setView(s, v) {
    const [fx, fy, fw, fh] = full(s);
    const w = Math.min(fw, Math.max(fw / MAX_ZOOM, v[2]));
    const h = (w * fh) / fw; // the drawing's own proportions: nothing is stretched
    const x = Math.min(fx + fw - w, Math.max(fx, v[0]));
    const y = Math.min(fy + fh - h, Math.max(fy, v[1]));
    s.setAttribute("viewBox", [x, y, w, h].map((n) => n.toFixed(1)).join(" "));
    state.view = w >= fw ? null : [x, y, w, h];
  }

  function toUser(s, clientX, clientY) {
    const m = s.getScreenCTM();
    if (!m) {
      return null;
    }
    const p = new DOMPoint(clientX, clientY).matrixTransform(m.inverse());
    return [p.x, p.y];
  }

  function zoom(s, factor, at) {
    const [x, y, w, h] = current(s);
    const [cx, cy] = at || [x + w / 2, y + h / 2];
    const nw = w / factor;
    const nh = h / factor;
    setView(s, [cx - ((cx - x) * nw) / w, cy - ((cy - y) * nh) / h, nw, nh]);
  }

  // -- what connects to what ------------------------------------------------------------------

  function cables(s, id) {
    if (cablesOf === null) {
      cablesOf = new Map();
      for (const c of s.querySelectorAll(".cable[data-a]")) {
        for (const end of [c.dataset.a, c.dataset.b]) {
          if (!cablesOf.has(end)) {
            cablesOf.set(end, []);
          }
          cablesOf.get(end).push(c);
        }
      }
    }
    return cablesOf.get(id) || [];
  }

  function adaptersOf(s, node) {
    return Array.from(s.querySelectorAll(".ad")).filter((a) => node && a.dataset.node === node);
  }

  // The mark, its cables, the marks at their other ends, and the node labels of the adapters among them.
  function related(s, el) {
    const out = new Set([el]);
    const addEnds = (c) => {
      out.add(c);
      for (const end of [c.dataset.a, c.dataset.b]) {
        const e = document.getElementById(end);
        if (e) {
          out.add(e);
        }
      }
    };
    if (el.classList.contains("cable")) {
      addEnds(el);
    } else {
      const starts = el.classList.contains("node-label") ? adaptersOf(s, el.dataset.node) : [el];
      for (const a of starts) {
        out.add(a);
        cables(s, a.id).forEach(addEnds);
      }
    }
    for (const e of Array.from(out)) {
      if (e.classList.contains("ad") && e.dataset.node) {
        for (const l of s.querySelectorAll(".node-label")) {
          if (l.dataset.node === e.dataset.node) {
            out.add(l);
          }
        }
      }
    }
    return out;
  }

  function light(s, el) {
    unlight(s);
    for (const e of related(s, el)) {
      e.classList.add("lit");
    }
    s.classList.add("fading");
  }

  function unlight(s) {
    hovered = null;
    s.classList.remove("fading");
    for (const e of s.querySelectorAll(".lit")) {
      e.classList.remove("lit");
    }
  }

  // -- the detail panel ---------------------------------------------------------------------

  function titleLines(el) {
    const t = el.querySelector(":scope > title");
    return t ? t.textContent.split("\n") : [];
  }

  function element(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) {
      e.textContent = text;
    }
    if (cls) {
      e.className = cls;
    }
    return e;
  }

  function showDetail(s, el) {
    const panel = document.getElementById("fabric-detail");
    if (!panel) {
      return;
    }
    for (const e of s.querySelectorAll(".selected")) {
      e.classList.remove("selected");
    }
    el.classList.add("selected");
    state.selected = el.id || null;
    const lines = titleLines(el);
    const close = element("button", "×", "secondary fab-close");
    close.type = "button";
    close.setAttribute("aria-label", "Close the details");
    close.dataset.closeDetail = "";
    const list = element("ul");
    for (const line of lines.slice(1)) {
      list.append(element("li", line));
    }
    panel.replaceChildren(close, element("h3", lines[0] || ""), list);
    if (el.dataset.llmgw) {
      const a = element("a", "The node's page");
      a.href = "/admin/nodes/" + encodeURIComponent(el.dataset.llmgw);
      panel.append(element("p"));
      panel.lastChild.append(a);
    }
    const own = el.id ? cables(s, el.id) : [];
    if (own.length > 1) {
      panel.append(element("p", own.length + " cables:"));
      const more = element("ul");
      for (const c of own) {
        const [ends, rate, why] = titleLines(c);
        more.append(element("li", ends + ": " + rate + (why ? "; " + why : ""), c.classList.contains("degraded") ? "bad" : ""));
      }
      panel.append(more);
    }
    panel.hidden = false;
  }

  // -- finding a node -------------------------------------------------------------------------

  function find(s, asked) {
    state.find = asked;
    for (const e of s.querySelectorAll(".found")) {
      e.classList.remove("found");
    }
    s.classList.remove("finding");
    const box = document.getElementById("fabric-found");
    const want = asked.trim().toLowerCase();
    if (!want) {
      if (box) {
        box.replaceChildren();
      }
      return;
    }
    const hit = Array.from(s.querySelectorAll(".ad")).filter(
      (a) => (a.dataset.node || "").toLowerCase() === want || (a.dataset.llmgw || "").toLowerCase() === want,
    );
    if (!box) {
      return;
    }
    if (!hit.length) {
      box.replaceChildren(element("p", "No node named “" + asked.trim() + "” has an adapter on this fabric.", "problem"));
      return;
    }
    for (const a of hit) {
      for (const e of related(s, a)) {
        if (!e.classList.contains("ad") || hit.includes(e)) {
          e.classList.add("found");
        }
      }
    }
    s.classList.add("finding");
    const node = hit[0].dataset.node || hit[0].dataset.llmgw;
    const head = element("p");
    head.append(element("strong", node), ": " + hit.length + " adapter" + (hit.length === 1 ? "" : "s") + " on this fabric");
    const list = element("ul", undefined, "admin-list");
    for (const a of hit) {
      list.append(element("li", titleLines(a).join("; ")));
    }
    box.replaceChildren(head, list);
  }

  function colour(s, byRail) {
    state.byRail = byRail;
    s.classList.toggle("by-rail", byRail);
    for (const a of document.querySelectorAll("a[data-colour]")) {
      if ((a.dataset.colour === "rail") === byRail) {
        a.setAttribute("aria-current", "page");
      } else {
        a.removeAttribute("aria-current");
      }
    }
  }

  // The address says what is shown, so a reload (or the link copied) shows it again.
  function remember(key, value) {
    const url = new URL(window.location.href);
    if (value) {
      url.searchParams.set(key, value);
    } else {
      url.searchParams.delete(key);
    }
    window.history.replaceState(null, "", url);
  }

  // -- wiring -----------------------------------------------------------------------------------

  function restore() {
    const s = svg();
    if (!s) {
      return;
    }
    cablesOf = null;
    if (state.view) {
      setView(s, state.view);
    }
    if (state.byRail !== null) {
      colour(s, state.byRail);
    }
    if (state.find !== null) {
      find(s, state.find);
    }
    const chosen = state.selected && document.getElementById(state.selected);
    if (chosen) {
      chosen.classList.add("selected");
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const e of document.querySelectorAll("[data-zoom-tools]")) {
      e.hidden = false;
    }
  });

  document.addEventListener("htmx:afterSettle", restore);

  document.addEventListener("click", (event) => {
    const s = svg();
    const t = event.target;
    if (!s || !(t instanceof Element)) {
      return;
    }
    const button = t.closest("[data-zoom]");
    if (button) {
      const how = button.dataset.zoom;
      if (how === "fit") {
        setView(s, full(s));
      } else {
        zoom(s, how === "in" ? 1.6 : 1 / 1.6);
      }
      return;
    }
    const pill = t.closest("a[data-colour]");
    if (pill) {
      event.preventDefault();
      colour(s, pill.dataset.colour === "rail");
      remember("colour", state.byRail ? "rail" : "");
      return;
    }
    if (t.closest("[data-close-detail]")) {
      const panel = document.getElementById("fabric-detail");
      panel.hidden = true;
      state.selected = null;
      for (const e of s.querySelectorAll(".selected")) {
        e.classList.remove("selected");
      }
    }
  });

  document.addEventListener("submit", (event) => {
    const s = svg();
    if (!s || event.target.id !== "fabric-find") {
      return;
    }
    event.preventDefault();
    const asked = event.target.elements.namedItem("find").value;
    find(s, asked);
    remember("find", asked.trim());
  });

  document.addEventListener(
    "wheel",
    (event) => {
      const s = svg();
      if (!s || !s.contains(event.target)) {
        return;
      }
      event.preventDefault();
      const step = event.deltaMode === 1 ? 0.05 : 0.0015; // lines or pixels
      zoom(s, Math.exp(-event.deltaY * step), toUser(s, event.clientX, event.clientY));
    },
    { passive: false },
  );

  document.addEventListener("pointerdown", (event) => {
    const s = svg();
    if (!s || !s.contains(event.target) || event.button !== 0) {
      return;
    }
    drag = { x: event.clientX, y: event.clientY, view: current(s), moved: false, id: event.pointerId };
  });

  document.addEventListener("pointermove", (event) => {
    const s = svg();
    if (!s) {
      return;
    }
    if (drag && drag.id === event.pointerId) {
      const dx = event.clientX - drag.x;
      const dy = event.clientY - drag.y;
      if (!drag.moved && Math.hypot(dx, dy) < 4) {
        return;
      }
      if (!drag.moved) {
        drag.moved = true;
        s.classList.add("dragging");
        s.setPointerCapture(event.pointerId);
        unlight(s);
      }
      const m = s.getScreenCTM();
      const scale = m ? m.a : 1; // screen pixels per unit of the viewBox
      const [x, y, w, h] = drag.view;
      setView(s, [x - dx / scale, y - dy / scale, w, h]);
      return;
    }
    const mark = event.target instanceof Element && s.contains(event.target) ? event.target.closest(MARKS) : null;
    if (mark && mark !== hovered) {
      light(s, mark);
      hovered = mark;
    } else if (!mark && hovered) {
      unlight(s);
    }
  });

  document.addEventListener("pointerleave", () => {
    const s = svg();
    if (s) {
      unlight(s);
    }
  });

  document.addEventListener("pointerup", (event) => {
    const s = svg();
    if (!drag || drag.id !== event.pointerId) {
      return;
    }
    const clicked = !drag.moved;
    drag = null;
    if (!s) {
      return;
    }
    s.classList.remove("dragging");
    if (!clicked || !(event.target instanceof Element) || !s.contains(event.target)) {
      return;
    }
    const mark = event.target.closest(MARKS);
    if (mark && !mark.closest("a")) {
      showDetail(s, mark);
    }
  });

  document.addEventListener("pointercancel", () => {
    drag = null;
  });
})();
