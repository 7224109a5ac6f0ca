// The playground page: tabs, the API key dialog, and the first contact with the server (/v1/models for the
// model, /server for its defaults and devices). Everything else lives in chat.js and server.js.

import { KeyNeeded, getJSON, saveKey, storedKey } from "./api.js";
import { Chat } from "./chat.js";
import { devices } from "./figures.js";
import { ServerView } from "./server.js";
import { installTips } from "./tokens.js";

const $ = (id) => document.getElementById(id);
const tabs = ["chat", "server"];

function askKey(reason) {
  const dialog = $("key-dialog");
  if (dialog.open) return;
  const keep = "It stays in this browser (local storage).";
  if (!reason) $("key-reason").textContent = `The server's API key. ${keep}`;
  else if (storedKey()) $("key-reason").textContent = `The saved key was refused (${reason}).`;
  else $("key-reason").textContent = `This server requires an API key. ${keep}`;
  $("key-input").value = storedKey();
  dialog.showModal();
}

function selectTab(name, focus = false) {
  for (const tab of tabs) {
    const button = $(`tab-${tab}`);
    const selected = tab === name;
    button.setAttribute("aria-selected", String(selected));
    button.tabIndex = selected ? 0 : -1;
    $(tab).hidden = !selected;
    if (selected && focus) button.focus();
  }
  server.show(name === "server");
}

async function connect() {
  try {
    const models = await getJSON("/v1/models");
    const model = models.data[0];
    const info = await getJSON("/server");
    // the server's mode and gamma fill the settings before the model's name says the page is ready: filled later,
    // they overwrote a mode the user had already chosen
    if (info.mode) $("mode").value = info.mode;
    if (info.gamma) $("gamma").value = info.gamma;
    $("max-tokens").max = model.max_model_len;
    $("model").textContent = model.id;
    devices(info);
    $("status").textContent = "";
  } catch (error) {
    if (error instanceof KeyNeeded) {
      $("model").textContent = "API key needed";
      askKey(error.message);
      return;
    }
    $("model").textContent = "not ready";
    $("status").textContent = `${error.message}; trying again…`;
    setTimeout(connect, 2000);
  }
}

new Chat(askKey);
const server = new ServerView(askKey);
installTips($("tip"));

tabs.forEach((name, index) => {
  const button = $(`tab-${name}`);
  button.addEventListener("click", () => selectTab(name));
  button.addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (step) selectTab(tabs[(index + step + tabs.length) % tabs.length], true);
  });
});

$("key-button").addEventListener("click", () => askKey(""));
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  saveKey($("key-input").value.trim());
  $("key-dialog").close();
  connect();
  if (!$("server").hidden) server.show(true);
});
$("key-forget").addEventListener("click", () => {
  saveKey("");
  $("key-dialog").close();
});
$("key-cancel").addEventListener("click", () => $("key-dialog").close());
document.addEventListener("visibilitychange", () => server.show(!document.hidden && !$("server").hidden));

connect();
