// The search page: plain JavaScript against the service's own API (no CDN, no build step).
"use strict";

const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem("clipms-token");

async function api(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch(path, body === undefined ? { headers } :
    { method: "POST", headers, body: JSON.stringify(body) });
  if (response.status === 401) {
    token = window.prompt("This service needs its bearer token:");
    if (token) { sessionStorage.setItem("clipms-token", token); return api(path, body); }
  }
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function showStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "status error" : "status";
}

async function thumbnailSource(url) {
  if (!token) return url;
  const response = await fetch(url, { headers: { "Authorization": "Bearer " + token } });
  return URL.createObjectURL(await response.blob());
}

async function showResults(data, what) {
  const grid = $("results");
  grid.replaceChildren();
  for (const hit of data.results) {
    const card = document.createElement("figure");
    card.className = "result";
    card.dataset.key = hit.key;
    card.title = "More like this";
    const img = document.createElement("img");
    img.alt = hit.caption;
    img.src = await thumbnailSource(hit.thumbnail_url);
    const caption = document.createElement("figcaption");
    caption.className = "caption";
    caption.textContent = hit.caption;
    const score = document.createElement("p");
    score.className = "score";
    score.textContent = "score " + hit.score.toFixed(3);
    card.append(img, caption, score);
    card.addEventListener("click", () => search({ key: hit.key }, "images like \u201c" + hit.caption + "\u201d"));
    grid.append(card);
  }
  showStatus(data.results.length + " results for " + what + " (model " + data.model.name +
             " v" + data.model.version + ")");
}

async function search(query, what) {
  showStatus("searching...");
  try {
    await showResults(await api("/v1/search", { ...query, k: 24 }), what);
  } catch (err) {
    showStatus(err.message, true);
  }
}

$("search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("query").value.trim();
  if (text) search({ text }, "\u201c" + text + "\u201d");
});

$("image-file").addEventListener("change", () => {
  const file = $("image-file").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => search({ image: reader.result.split(",", 2)[1] }, "the image " + file.name);
  reader.readAsDataURL(file);
});

api("/v1/model").then((m) => {
  $("model").textContent = "model " + m.name + " v" + m.version +
    (m.alias ? " @" + m.alias : "") + " \u00b7 " + m.index_rows + " images indexed";
}).catch((err) => showStatus(err.message, true));
