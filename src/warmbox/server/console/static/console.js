// warmbox console: keeps [data-refresh] regions current. No inline script anywhere (the CSP
// forbids it); what is swapped in is HTML the server rendered with autoescaping.
"use strict";
(function () {
  var LOGIN = "/ui/login";

  // Put the server's fragment into el. When both are the same list of children with ids (the
  // sections of a sandbox's page), only the sections that changed are replaced: a table the
  // operator is reading or selecting in stays put while the usage numbers tick.
  function swap(el, html) {
    var t = document.createElement("template");
    t.innerHTML = html;
    var fresh = Array.prototype.slice.call(t.content.children);
    var old = Array.prototype.slice.call(el.children);
    var same =
      fresh.length > 0 &&
      fresh.length === old.length &&
      fresh.every(function (c, i) {
        return c.id && c.id === old[i].id;
      });
    if (!same) {
      el.replaceChildren(t.content);
      return;
    }
    fresh.forEach(function (c, i) {
      if (c.outerHTML !== old[i].outerHTML) {
        el.replaceChild(c, old[i]);
      }
    });
  }

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
            swap(el, got.text);
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
    if (el.hasAttribute("data-refresh-now")) {
      tick(); // rendered empty: fill it at once
    }
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
