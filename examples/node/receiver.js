// A Node.js consumer of fluxora-webhooks deliveries: verify, apply each delivery once, answer.
//
//     npm ci                                  # standardwebhooks (and svix), as pinned here
//     WEBHOOK_SECRET=whsec_... PORT=8080 node receiver.js
//
// WEBHOOK_SECRET is the endpoint's secret as the portal (or `endpoints add`) showed it. A
// plain secret (not whsec_...) is given to the library as "whsec_" + its base64:
// "whsec_" + Buffer.from(plain, "utf8").toString("base64").
//
// Answers: 200 applied or already applied (a repeat: the sender stops retrying), 401 not
// signed with the secret or too old, 413 too large, 500 the handler threw and 503 a copy of
// the same delivery is being handled (the sender retries both later, with the same id).
// A 4xx other than 408/425/429 dead-letters the delivery: never answer one for a retry.
//
// The ids applied are kept in memory, for one process. A real consumer records the
// webhook-id in its database, in the transaction that applies the event (docs/consumers.md,
// "From any language").
"use strict";

const http = require("node:http");
const { Webhook } = require("standardwebhooks"); // or: const { Webhook } = require("svix");

// The sender's payloads are at most 1 MiB as the producer wrote them; PostgreSQL's jsonb
// text can be longer (a number in exponent form is written out in full): leave room.
const MAX_BODY_BYTES = 2 * 1024 * 1024;

function createReceiver({ secret, handle, applied = new Set() }) {
  const webhook = new Webhook(secret); // throws at once on a secret that is not whsec_ + base64
  const inFlight = new Set();

  return http.createServer((req, res) => {
    const answer = (status, body, headers = {}) => {
      res.writeHead(status, { "content-type": "application/json", ...headers });
      res.end(JSON.stringify(body));
    };
    const chunks = [];
    let size = 0;
    req.on("data", (chunk) => {
      size += chunk.length;
      if (size <= MAX_BODY_BYTES) chunks.push(chunk);
    });
    req.on("end", async () => {
      if (size > MAX_BODY_BYTES) return answer(413, { error: "body_too_large" });
      // The raw bytes, as signed: never JSON.stringify(JSON.parse(body)) (with Express:
      // express.raw({ type: "application/json", limit: "2mb" }), not express.json()).
      const body = Buffer.concat(chunks);
      let event;
      try {
        // Checks webhook-id, webhook-timestamp (within 5 minutes) and every "v1,..."
        // entry of webhook-signature (two during a secret rotation), in constant time.
        event = webhook.verify(body, req.headers);
      } catch {
        return answer(401, { error: "verification_failed" });
      }
      const id = req.headers["webhook-id"]; // signed; the same on every retry and replay
      if (applied.has(id)) {
        return answer(200, { status: "duplicate", delivery_id: id });
      }
      if (inFlight.has(id)) {
        // Another copy of this delivery is being handled: retry later (a 4xx would
        // dead-letter it).
        return answer(503, { error: "in_progress" }, { "retry-after": "5" });
      }
      inFlight.add(id);
      try {
        await handle(event, {
          id,
          type: req.headers["x-fluxora-event"], // unsigned: for routing and logs
          attempt: Number(req.headers["x-fluxora-attempt"]),
        });
        applied.add(id); // only once applied: a failed attempt must not look like a repeat
      } catch (err) {
        console.error(`delivery ${id} failed:`, err);
        return answer(500, { error: "handler_failed" });
      } finally {
        inFlight.delete(id);
      }
      return answer(200, { status: "processed", delivery_id: id });
    });
  });
}

module.exports = { createReceiver, MAX_BODY_BYTES };

if (require.main === module) {
  const port = Number(process.env.PORT || 8080);
  const server = createReceiver({
    secret: process.env.WEBHOOK_SECRET,
    handle: async (event, { id, type, attempt }) => {
      console.log(`${type} ${id} (attempt ${attempt}):`, JSON.stringify(event).slice(0, 200));
    },
  });
  server.listen(port, "127.0.0.1", () => console.log(`listening on http://127.0.0.1:${port}`));
}
