// A plain script, run before the page's modules: when a file of the page does not load (a busy or restarting
// server answered it with an error), the modules never run and the page would stay on "connecting…" without a
// word; this says which file failed instead. It is the page's only non-module script and imports nothing.
"use strict";

window.addEventListener("error", (event) => {
  const failed = event.target;
  if (!(failed instanceof HTMLScriptElement || failed instanceof HTMLLinkElement)) return; // a script's own error
  const file = (failed.src || failed.href || "a file").replace(window.location.origin, "");
  const say = () => {
    const model = document.getElementById("model");
    const status = document.getElementById("status");
    const line = `a file of this page did not load (${file}, or one it imports): reload the page`;
    if (failed instanceof HTMLScriptElement && model) model.textContent = "page not loaded";
    if (status) {
      status.textContent = line;
      status.classList.add("error");
    }
    // the page's modules may run (a stylesheet failed) and rewrite the status line: the banner stays
    const banner = document.createElement("p");
    banner.className = "load-error";
    banner.setAttribute("role", "alert");
    banner.textContent = line;
    document.body.prepend(banner);
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", say);
  else say();
}, true); // a resource's error does not bubble: only a capturing listener on window sees it
