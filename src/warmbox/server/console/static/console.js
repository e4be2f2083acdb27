// warmbox console: keeps [data-refresh] regions current. No inline script anywhere (the CSP
// forbids it); what is swapped in is HTML the server rendered with autoescaping.
"use strict";
(function () {
  var LOGIN = "/ui/login";

  function keepFresh(el) {
    var url = el.getAttribute("data-refresh");
    var every = Math.max(500, parseInt(el.getAttribute("data-interval") || "1500", 10));
    var last = null;
    var busy = false;
    function tick() {
      if (busy || document.hidden) {
        return;
      }
      busy = true;
      fetch(url, { credentials: "same-origin", cache: "no-store", redirect: "error" })
        .then(function (r) {
          if (r.status === 401) {
            window.location.assign(LOGIN);
            return null;
          }
          return r.text().then(function (text) {
            return { ok: r.ok, text: text };
          });
        })
        .then(function (got) {
          if (got === null) {
            return;
          }
          // an error answer is a small escaped note: shown in place, the region marked stale
          if (got.text !== last) {
            last = got.text;
            el.innerHTML = got.text;
            el.dispatchEvent(new CustomEvent("console:refreshed", { bubbles: true }));
          }
          el.setAttribute("data-refreshed-at", String(Date.now()));
          if (got.ok) {
            el.removeAttribute("data-stale");
          } else {
            el.setAttribute("data-stale", "1");
          }
        })
        .catch(function () {
          el.setAttribute("data-stale", "1");
        })
        .then(function () {
          busy = false;
        });
    }
    window.setInterval(tick, every);
  }

  function confirmForms() {
    document.addEventListener("submit", function (ev) {
      var form = ev.target;
      var question = form && form.getAttribute && form.getAttribute("data-confirm");
      if (question && !window.confirm(question)) {
        ev.preventDefault();
      }
    });
  }

  document.querySelectorAll("[data-refresh]").forEach(keepFresh);
  confirmForms();
})();
