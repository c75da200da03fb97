// Suggest users and API keys in the admin's subject fields, as the identifiers the limiter uses.
"use strict";
(function () {
  function attach(kindSelect, idInput) {
    const url = idInput.dataset.suggestUrl;
    const list = document.createElement("datalist");
    list.id = idInput.id + "-suggestions";
    idInput.after(list);
    idInput.setAttribute("list", list.id);
    idInput.setAttribute("autocomplete", "off");
    let timer = null;
    idInput.addEventListener("input", function () {
      clearTimeout(timer);
      const kind = kindSelect.value;
      const term = idInput.value.trim();
      if (!term || (kind !== "user" && kind !== "api_key")) {
        list.replaceChildren();
        return;
      }
      timer = setTimeout(function () {
        const query = new URLSearchParams({kind: kind, term: term});
        fetch(url + "?" + query.toString(), {credentials: "same-origin"})
          .then(function (response) { return response.ok ? response.json() : {results: []}; })
          .then(function (data) {
            list.replaceChildren(...data.results.map(function (item) {
              const option = document.createElement("option");
              option.value = item.id;
              option.label = item.text;
              return option;
            }));
          })
          .catch(function () { list.replaceChildren(); });
      }, 200);
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("input[data-suggest-url]").forEach(function (input) {
      const kind = document.getElementById(input.dataset.kindField);
      if (kind) {
        attach(kind, input);
      }
    });
  });
})();
