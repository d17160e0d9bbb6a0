// The administrator's pages: the parts marked data-refresh are fetched again by htmx
// (hx-trigger="every 5s, refresh"). htmx's own [condition] filters need eval, which the
// pages' Content-Security-Policy forbids, so the pause while the tab is hidden is here:
// no request while hidden, and one at once when the tab is shown again. A followed log
// stays scrolled to its newest line.
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
