// The dashboard's only script (served from this server: the CSP allows no other).
// Progressive enhancement: every page works without it.
"use strict";

document.addEventListener("DOMContentLoaded", function () {
  // Copy a shown-once secret to the clipboard.
  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    button.addEventListener("click", function () {
      var target = document.getElementById(button.getAttribute("data-copy"));
      if (!target || !navigator.clipboard) return;
      navigator.clipboard.writeText(target.textContent || "").then(function () {
        button.textContent = "Copied";
      });
    });
  });
  // A button that changes something is pressed once: a second click would post twice.
  document.querySelectorAll("form[method=post]").forEach(function (form) {
    form.addEventListener("submit", function () {
      form.querySelectorAll("button[type=submit]").forEach(function (b) {
        b.disabled = true;
      });
    });
  });
});
