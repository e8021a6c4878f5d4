// The dashboard's only script (served from this server: the CSP allows no other).
// Progressive enhancement: every page works without it.
"use strict";

// Where the focus starts: a field a form was sent back for, else an action's result (on a
// list, the button of the row it was about, described by it): a screen reader says it,
// and the keyboard goes on from there rather than from the top of the page. At load, not
// before: the browser's move to a #fragment (the row) resets the focus until then.
window.addEventListener("load", function () {
  var active = document.activeElement;
  if (active && active !== document.body) return; // the user has moved it already
  // A form's problem that no field of it has (a cap reached): the message itself.
  var invalid =
    document.querySelector("main [aria-invalid=true]") ||
    document.querySelector("main .error[tabindex='-1']");
  var flash = document.getElementById("flash");
  if (invalid) {
    invalid.focus();
  } else if (flash) {
    var row = null;
    if (location.hash.length > 1) {
      try {
        row = document.getElementById(decodeURIComponent(location.hash.slice(1)));
      } catch (e) {
        row = null; // not a fragment this page wrote
      }
    }
    var button = row && row.querySelector("button[data-action]");
    if (button) {
      button.setAttribute("aria-describedby", "flash");
      button.focus();
    } else {
      flash.focus();
    }
  }
});

document.addEventListener("DOMContentLoaded", function () {
  // A shown-once secret: selected whole when its field gets the focus, and copied by
  // Copy: with the clipboard API where the page may use it (https, localhost), else as
  // the selection (plain http elsewhere has no navigator.clipboard). The outcome is said
  // in the button's status.
  document.querySelectorAll("input.secret").forEach(function (field) {
    field.addEventListener("focus", function () {
      field.select();
    });
  });
  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    var field = document.getElementById(button.getAttribute("data-copy"));
    var status = document.getElementById(button.getAttribute("data-status") || "");
    if (!field) return;
    function say(text) {
      if (!status) return;
      status.textContent = ""; // the same words again are still announced
      window.setTimeout(function () {
        status.textContent = text;
      }, 50);
    }
    function copySelection() {
      field.focus();
      field.select();
      var copied = false;
      try {
        copied = document.execCommand("copy");
      } catch (e) {
        copied = false;
      }
      say(copied ? "Copied" : "Copy failed: select the secret and press Ctrl+C");
    }
    button.addEventListener("click", function () {
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(field.value).then(function () {
          say("Copied");
        }, copySelection);
      } else {
        copySelection();
      }
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
