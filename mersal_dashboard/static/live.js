// The dashboard's only script: refreshes the parts marked data-live, and "select all" boxes.
"use strict";

function refresh(part) {
  const every = Number(part.dataset.every || 2) * 1000;
  const tick = async () => {
    try {
      const answer = await fetch(part.dataset.live, { credentials: "same-origin" });
      if (answer.ok) {
        part.innerHTML = await answer.text();
        part.dataset.refreshed = String(Number(part.dataset.refreshed || 0) + 1);
      }
    } catch (error) {
      // the dashboard is restarting or the network is down: try again next time
    }
    if (!part.querySelector("[data-final]")) {
      setTimeout(tick, every);
    }
  };
  if (!part.querySelector("[data-final]")) {
    setTimeout(tick, every);
  }
}

function selectAll(box) {
  box.addEventListener("change", () => {
    for (const other of box.form.querySelectorAll(`input[name="${box.dataset.selectAll}"]`)) {
      other.checked = box.checked;
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(refresh);
  document.querySelectorAll("[data-select-all]").forEach(selectAll);
});
