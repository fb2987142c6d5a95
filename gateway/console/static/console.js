// fencegate console: the one own script (CSP: script-src 'self'). Optional: every page works
// without it. It offers local time next to UTC, remembered in localStorage.
(function () {
  "use strict";
  var KEY = "fencegate.console.localTime";
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
  });
  document.addEventListener("htmx:afterSwap", function (e) { render(e.target); });
  document.addEventListener("htmx:sseMessage", function (e) { render(e.target); });
})();
