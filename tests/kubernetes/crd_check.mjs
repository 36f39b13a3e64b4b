// Validates the custom resources of a rendered deployment (KEDA, the Prometheus operator,
// cert-manager) against their CRDs' published schemas, as compiled into the @kubernetes-models
// packages (npm). Reads a JSON array of objects on stdin;
// prints one JSON line per checked object and exits 1 if any is invalid.
const models = {
  "keda.sh/v1alpha1/ScaledObject": async () => (await import("@kubernetes-models/keda/keda.sh/v1alpha1")).ScaledObject,
  "monitoring.coreos.com/v1/ServiceMonitor": async () =>
    (await import("@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1")).ServiceMonitor,
  "cert-manager.io/v1/Certificate": async () =>
    (await import("@kubernetes-models/cert-manager/cert-manager.io/v1")).Certificate,
  "cert-manager.io/v1/Issuer": async () => (await import("@kubernetes-models/cert-manager/cert-manager.io/v1")).Issuer,
};
let input = "";
for await (const chunk of process.stdin) input += chunk;
let failed = false;
for (const obj of JSON.parse(input)) {
  const load = models[`${obj.apiVersion}/${obj.kind}`];
  if (!load) continue;
  const Model = await load();
  const line = { kind: obj.kind, name: obj.metadata.name, valid: true };
  try {
    new Model(obj).validate();
  } catch (err) {
    failed = true;
    Object.assign(line, { valid: false, error: String(err.message || err) });
  }
  console.log(JSON.stringify(line));
}
process.exit(failed ? 1 : 0);
