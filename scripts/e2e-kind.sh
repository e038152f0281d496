#!/usr/bin/env bash
# End to end on a real Kubernetes API: a kind cluster, the broker chart with its
# admission webhook, a training Job that the webhook debug-overlays, and
# `breakpod attach` through `kubectl port-forward`. Needs docker, kind, kubectl,
# openssl and network access for the images; NOT run in CI (no Kubernetes API
# can run there). Usage: make e2e-kind   (KEEP=1 keeps the cluster).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-breakpod-e2e}
NS=breakpod
TRAIN_NS=ml
RELEASE=bp
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d)

for tool in docker kind kubectl openssl; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is not installed; skipping"; exit 0; }
done

cleanup() {
  [[ -n "${PF_PID:-}" ]] && kill "$PF_PID" 2>/dev/null || true
  [[ "${KEEP:-0}" == 1 ]] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }

step "images"
cat > "$WORK/base.Dockerfile" <<'DOCKERFILE'
FROM python:3.11-slim-bookworm
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu
DOCKERFILE
docker build -q -t breakpod-train-base:dev -f "$WORK/base.Dockerfile" "$WORK"
docker build -q -t breakpod-train:dev -f docker/debug.Dockerfile --build-arg BASE_IMAGE=breakpod-train-base:dev .
docker build -q -t breakpod-broker:dev -f docker/broker.Dockerfile .

step "cluster"
kind create cluster --name "$CLUSTER" --wait 120s
kind load docker-image --name "$CLUSTER" breakpod-broker:dev breakpod-train:dev
kubectl create namespace "$NS"
kubectl create namespace "$TRAIN_NS"
kubectl label namespace "$TRAIN_NS" breakpod.dev/inject=enabled

step "webhook certificate (webhook.tls.secretName mode)"
SVC="$RELEASE-breakpod.$NS.svc"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=breakpod-e2e-ca \
  -keyout "$WORK/ca.key" -out "$WORK/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SVC" -keyout "$WORK/tls.key" -out "$WORK/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s\n' "$SVC" > "$WORK/ext.cnf"
openssl x509 -req -in "$WORK/tls.csr" -CA "$WORK/ca.crt" -CAkey "$WORK/ca.key" -CAcreateserial \
  -days 1 -extfile "$WORK/ext.cnf" -out "$WORK/tls.crt" 2>/dev/null
kubectl -n "$NS" create secret tls breakpod-webhook-tls --cert "$WORK/tls.crt" --key "$WORK/tls.key"

step "helm install"
# tty/stdin off: with a TTY on stdin, breakpoint() opens pdb on that TTY
# (kubectl attach -it) instead of parking on the socket this test attaches to.
CA_BUNDLE=$(base64 -w0 < "$WORK/ca.crt")
"$PY" - "$RELEASE" "$NS" "$CA_BUNDLE" <<'PYTHON'
import sys, yaml, helm_python as helm
release, ns, ca = sys.argv[1:]
values = yaml.safe_load(open("helm/breakpod/ci/cpu-kind-values.yaml"))
values["webhook"] = {"enabled": True, "tls": {"certManager": {"enabled": False},
                     "secretName": "breakpod-webhook-tls", "caBundle": ca}}
values["overlay"].update(tty=False, stdin=False)
with helm.Config(namespace=ns) as cfg:
    print(cfg.install("helm/breakpod", release, values, wait="watcher", timeout=300)["status"])
PYTHON
AGENT_TOKEN=$(kubectl -n "$NS" get secret "$RELEASE-breakpod" -o jsonpath='{.data.agent-token}' | base64 -d)
kubectl -n "$TRAIN_NS" create secret generic breakpod-agent-token --from-literal=token="$AGENT_TOKEN"
kubectl -n "$TRAIN_NS" create configmap train-nan --from-file=examples/train_nan.py

step "training Job (labelled breakpod.dev/inject: \"true\")"
kubectl -n "$TRAIN_NS" apply -f - <<'YAML'
apiVersion: batch/v1
kind: Job
metadata: {name: train-nan}
spec:
  backoffLimit: 0
  template:
    metadata:
      labels: {breakpod.dev/inject: "true"}
    spec:
      restartPolicy: Never
      containers:
        - name: train
          image: breakpod-train:dev
          imagePullPolicy: Never
          command: [python, /app/train_nan.py]
          volumeMounts: [{name: code, mountPath: /app}]
      volumes: [{name: code, configMap: {name: train-nan}}]
YAML
kubectl -n "$TRAIN_NS" wait --for=condition=Ready pod -l job-name=train-nan --timeout=180s
POD=$(kubectl -n "$TRAIN_NS" get pod -l job-name=train-nan -o jsonpath='{.items[0].metadata.name}')
kubectl -n "$TRAIN_NS" get pod "$POD" -o jsonpath='{.spec.containers[0].env[*].name}' | grep -q PYTHONBREAKPOINT \
  || { echo "e2e-kind: the webhook did not apply the overlay"; exit 1; }
echo "overlay applied to $POD"
for _ in $(seq 60); do
  kubectl -n "$TRAIN_NS" logs "$POD" | grep -q "for a debugger on" && break
  sleep 2
done
kubectl -n "$TRAIN_NS" logs "$POD"

step "breakpod attach through kubectl port-forward"
kubectl -n "$TRAIN_NS" port-forward "pod/$POD" 15678:5678 >/dev/null &
PF_PID=$!
sleep 3
printf 'p loss\nc\n' | timeout 60 "$PY" -m breakpod._cli.main attach 127.0.0.1:15678
kubectl -n "$TRAIN_NS" wait --for=condition=complete job/train-nan --timeout=120s
kubectl -n "$TRAIN_NS" logs "$POD" | tail -n 3
echo "e2e-kind: OK"
