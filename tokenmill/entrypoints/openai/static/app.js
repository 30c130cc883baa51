// The page's entry point: the two views as tabs, and the API key field.
import {startDashboard, stopDashboard} from "./dashboard.js";
import {initPlayground, loadModels} from "./playground.js";

const KEY_STORE = "tokenmill-api-key";  // this tab's session only: gone with the browser
const tabs = [...document.querySelectorAll('[role="tab"]')];

function select(tab) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
  }
  const view = tab.id.replace("tab-", "");
  history.replaceState(null, "", `#${view}`);
  if (view === "dashboard") startDashboard(); else stopDashboard();
}

for (const tab of tabs) {
  tab.addEventListener("click", () => select(tab));
  // arrow keys move between tabs (the ARIA tabs pattern)
  tab.addEventListener("keydown", (event) => {
    const step = {ArrowRight: 1, ArrowLeft: -1}[event.key];
    if (!step) return;
    const next = tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length];
    next.focus();
    select(next);
  });
}

const key = document.getElementById("api-key");
key.value = sessionStorage.getItem(KEY_STORE) || "";
key.addEventListener("input", () => sessionStorage.setItem(KEY_STORE, key.value));
key.addEventListener("change", loadModels);  // a new key may open the model list

initPlayground();
loadModels();
select(tabs.find((t) => `#${t.id.replace("tab-", "")}` === location.hash) || tabs[0]);
