// The administrator's pages: the parts marked data-refresh are fetched again by htmx
// (hx-trigger="every 5s, refresh"). htmx's own [condition] filters need eval, which the
// pages' Content-Security-Policy forbids, so the pause while the tab is hidden is here:
// no request while hidden, and one at once when the tab is shown again. A followed log
// stays scrolled to its newest line. On People (data-keep-open) htmx sends the forms and swaps
// only that part of the page: the projects open before stay open after, and a refusal (400,
// 409: the page with the store's sentence) is swapped like any answer.
"use strict";

document.addEventListener("htmx:beforeRequest", (event) => {
  const elt = event.detail && event.detail.elt;
  if (document.visibilityState !== "visible" && elt && elt.hasAttribute("data-refresh")) {
    event.preventDefault();
  }
});

document.addEventListener("visibilitychange", () => {
  if (document.visibilityState !== "visible" || typeof htmx === "undefined") {
    return;
  }
  for (const elt of document.querySelectorAll("[data-refresh]")) {
    htmx.trigger(elt, "refresh");
  }
});

function followLog() {
  const log = document.querySelector("[data-follow] #log");
  if (log) {
    log.scrollTop = log.scrollHeight;
  }
}

document.addEventListener("DOMContentLoaded", followLog);
document.addEventListener("htmx:afterSettle", followLog);

let keptOpen = null;

document.addEventListener("htmx:beforeSwap", (event) => {
  const target = event.detail.target;
  if (!target || !target.hasAttribute("data-keep-open")) {
    return;
  }
  const status = event.detail.xhr.status;
  if (status === 400 || status === 409) {
    event.detail.shouldSwap = true;
    event.detail.isError = false;
  } else if (status >= 400) {
    // Signed out, or no longer an administrator: the page itself says so.
    window.location.reload();
    return;
  }
  keptOpen = Array.from(target.querySelectorAll("li[id] > details.admin-project[open]"), (d) => d.parentElement.id);
});

document.addEventListener("htmx:afterSettle", () => {
  if (keptOpen === null) {
    return;
  }
  for (const id of keptOpen) {
    const details = document.querySelector("#" + CSS.escape(id) + " > details.admin-project");
    if (details) {
      details.open = true;
    }
  }
  keptOpen = null;
});
