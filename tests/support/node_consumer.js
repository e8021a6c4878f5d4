// The Node.js consumer of tests/e2e/test_node_consumer.py: examples/node/receiver.js (the
// documented example, on the official standardwebhooks package) serving each endpoint, every
// request also checked by the svix package with each secret the test names.
//
//     node node_consumer.js '{"receivers": [{"name", "port", "secret"}], "check": {name: secret}}'
//
// One JSON line per event on stdout: {"ready": [ports]}, then {"request": {...}} for each
// request answered and {"applied": {...}} for each event the example's handler applied.
// Event types steer the handler: "test.fail-twice" throws on attempts 1 and 2 (answered 500),
// "test.lose-answer" is applied, then its first answer is lost (the connection closed).
"use strict";

const path = require("node:path");

const exampleDir = path.resolve(__dirname, "..", "..", "examples", "node");
const { createReceiver } = require(path.join(exampleDir, "receiver.js"));
const fromExample = (name) => require(require.resolve(name, { paths: [exampleDir] }));
const svix = fromExample("svix");
const standardwebhooks = fromExample("standardwebhooks");

const config = JSON.parse(process.argv[2]);
const emit = (line) => process.stdout.write(JSON.stringify(line) + "\n");

function checks(body, headers) {
  const results = {};
  for (const [name, secret] of Object.entries(config.check)) {
    try {
      new svix.Webhook(secret).verify(body, headers);
      results[`svix:${name}`] = "ok";
    } catch (err) {
      results[`svix:${name}`] = String(err.message);
    }
    try {
      // A string body, as a framework that decoded it hands it over (UTF-8).
      new standardwebhooks.Webhook(secret).verify(body.toString("utf8"), headers);
      results[`standardwebhooks-string:${name}`] = "ok";
    } catch (err) {
      results[`standardwebhooks-string:${name}`] = String(err.message);
    }
  }
  return results;
}

let listening = 0;
const ports = [];
for (const receiver of config.receivers) {
  const handle = async (event, meta) => {
    if (meta.type === "test.fail-twice" && meta.attempt <= 2) {
      throw new Error(`refused attempt ${meta.attempt} on purpose`);
    }
    emit({ applied: { receiver: receiver.name, event, ...meta } });
  };
  const server = createReceiver({ secret: receiver.secret, handle });
  const [example] = server.listeners("request");
  server.removeAllListeners("request");
  server.on("request", (req, res) => {
    const chunks = [];
    req.on("data", (chunk) => chunks.push(chunk));
    req.on("end", () => {
      const body = Buffer.concat(chunks);
      const seen = {
        receiver: receiver.name,
        url: req.url,
        headers: req.headers,
        bytes: body.length,
        sha: require("node:crypto").createHash("sha256").update(body).digest("hex"),
        checks: checks(body, req.headers),
      };
      const lose = req.headers["x-fluxora-event"] === "test.lose-answer" &&
        req.headers["x-fluxora-attempt"] === "1";
      const writeHead = res.writeHead.bind(res);
      res.writeHead = (status, ...rest) => {
        seen.status = status;
        if (lose) {
          seen.lost = true;
          emit({ request: seen });
          req.socket.destroy(); // applied, but the sender never hears of it
          return res;
        }
        emit({ request: seen });
        return writeHead(status, ...rest);
      };
      if (lose) res.end = () => res;
    });
    example(req, res);
  });
  server.listen(receiver.port, "127.0.0.1", () => {
    ports.push(receiver.port);
    listening += 1;
    if (listening === config.receivers.length) emit({ ready: ports });
  });
}
