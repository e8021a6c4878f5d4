"""The dashboard (SPEC 15): server-rendered pages over the same admin layer as the API,
signed in with a token. Jinja2 escapes everything it renders (stored payloads and response
bodies are text, never markup); the only script is ``static/app.js``, served from here."""
