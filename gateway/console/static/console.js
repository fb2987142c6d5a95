// fencegate console: the one own script (CSP: script-src 'self'). Optional: every page works
// without it. It offers local time next to UTC, remembered in localStorage, and keeps the
// proof of login: the login's redirect carries it in the fragment (#fg-proof=..., never sent
// to a server); it is kept in this origin's localStorage (a page on another port or host
// cannot read it) and added to every form posted, so that a cookie replayed from elsewhere
// cannot change anything. Without it a state-changing form asks for the API key again.
(function () {
  "use strict";
  var KEY = "fencegate.console.localTime";
  var PROOF = "fencegate.console.proof";
  var hash = window.location.hash;
  if (hash.indexOf("#fg-proof=") === 0) {
    window.localStorage.setItem(PROOF, hash.slice("#fg-proof=".length));
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
  }
  function proof() { return window.localStorage.getItem(PROOF) || ""; }
  document.addEventListener("submit", function (e) {
    var form = e.target;
    if (!(form instanceof HTMLFormElement) || form.method.toLowerCase() !== "post") { return; }
    if (form.getAttribute("action") === "/console/logout") {
      window.localStorage.removeItem(PROOF);
      return;
    }
    if (form.getAttribute("action") === "/console/login") { return; }
    var field = form.querySelector("input[name=proof]");
    if (!field) {
      field = document.createElement("input");
      field.type = "hidden";
      field.name = "proof";
      form.appendChild(field);
    }
    field.value = proof();
  }, true);
  function hideReauth(root) {
    if (!proof()) { return; }
    root.querySelectorAll("label.reauth").forEach(function (l) { l.hidden = true; });
  }
  function local() { return window.localStorage.getItem(KEY) === "1"; }
  function render(root) {
    var on = local();
    root.querySelectorAll("time[datetime]").forEach(function (t) {
      var iso = t.getAttribute("datetime");
      if (!iso) { return; }
      if (on) {
        var d = new Date(iso);
        if (!isNaN(d.getTime())) { t.textContent = d.toLocaleString(); t.title = iso; }
      } else {
        t.textContent = iso; t.removeAttribute("title");
      }
    });
    var button = document.getElementById("tz");
    if (button) { button.textContent = on ? "show UTC" : "show local time"; }
  }
  document.addEventListener("DOMContentLoaded", function () {
    var button = document.getElementById("tz");
    if (button) {
      button.hidden = false;
      button.addEventListener("click", function () {
        window.localStorage.setItem(KEY, local() ? "0" : "1");
        render(document);
      });
    }
    render(document);
    hideReauth(document);
  });
  document.addEventListener("htmx:afterSwap", function (e) { render(e.target); hideReauth(e.target); });
  document.addEventListener("htmx:sseMessage", function (e) { render(e.target); });
})();
