#!/usr/bin/env bash
# End to end against the Kubernetes cluster in KUBECONFIG (kind, k3d, a cloud
# cluster): helm install with the webhook, a labelled pod mutated by the API
# server calling the webhook and an unlabelled one untouched, failurePolicy
# Ignore while the webhook is down, RBAC checked with SubjectAccessReview,
# helm test, an OOM-killed pod reported with its reason, `breakpod attach` (the
# broker's kubectl port-forward to pod/NAME) and `breakpod stacks pod/NAME`.
# With no cluster reachable it skips in one line and exits 0.
#
# Inputs (environment):
#   IMAGE_REPOSITORY, IMAGE_TAG   the broker image (`make images`, pushed where the nodes pull)
#   TRAIN_IMAGE                   a training image with breakpod and torch (breakpod-debug)
#   REDIS_DIGEST                  sha256:... of redis:7.4-alpine, or REDIS_ALLOW_TAG=1
#   PULL_POLICY                   IfNotPresent (Never for images loaded into kind)
#   KEEP=1                        keep the release and namespaces afterwards
# Not run on the machines this project is developed on: they have no cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NS=${NS:-breakpod-e2e}
TRAIN_NS=${TRAIN_NS:-breakpod-e2e-train}
RELEASE=${RELEASE:-bp}
FULL="$RELEASE-breakpod"
BREAKPOD=("$PY" -m breakpod._cli.main)
WORK=$(mktemp -d)

skip() { echo "e2e-cluster: skipped: $*"; rm -rf "$WORK"; exit 0; }
die() { echo "e2e-cluster: FAILED: $*" >&2; exit 1; }

command -v kubectl >/dev/null || skip "kubectl is not installed"
if [[ -z "${KUBECONFIG:-}" && ! -f "$HOME/.kube/config" ]]; then
  skip "no KUBECONFIG and no ~/.kube/config"
fi
if ! kubectl version --request-timeout=5s >/dev/null 2>&1; then
  server=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}' 2>/dev/null || true)
  skip "no Kubernetes API server reachable (${server:-no current context in KUBECONFIG})"
fi
"$PY" -c "import helm_python" 2>/dev/null || die "$PY has no helm_python (make install)"
[[ -n "${IMAGE_REPOSITORY:-}" ]] || die "set IMAGE_REPOSITORY (and IMAGE_TAG): the broker image built by make images"
[[ -n "${TRAIN_IMAGE:-}" ]] || die "set TRAIN_IMAGE: a training image with breakpod and torch (docker/debug.Dockerfile)"
[[ -n "${REDIS_DIGEST:-}" || "${REDIS_ALLOW_TAG:-0}" == 1 ]] || die "set REDIS_DIGEST=sha256:... (or REDIS_ALLOW_TAG=1)"

cleanup() {
  [[ -n "${PF_PID:-}" ]] && kill "$PF_PID" 2>/dev/null || true
  if [[ "${KEEP:-0}" != 1 ]]; then
    "$PY" - "$RELEASE" "$NS" <<'PYTHON' >/dev/null 2>&1 || true
import sys, helm_python as helm
with helm.Config(namespace=sys.argv[2]) as cfg:
    cfg.uninstall(sys.argv[1])
PYTHON
    kubectl delete namespace "$NS" "$TRAIN_NS" --wait=false >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }

step "namespaces"
kubectl create namespace "$NS"
kubectl create namespace "$TRAIN_NS"
kubectl label namespace "$TRAIN_NS" breakpod.dev/inject=enabled

step "helm install (webhook, pod watch, stacks RBAC, a token for $TRAIN_NS)"
"$PY" - "$RELEASE" "$NS" "$TRAIN_NS" <<'PYTHON'
import os, sys, yaml, helm_python as helm
release, ns, train = sys.argv[1:]
# helm/breakpod/ci/e2e-cluster-values.yaml (rendered and validated by the chart
# tests), pointed at this run's training namespace and images
values = yaml.safe_load(open("helm/breakpod/ci/e2e-cluster-values.yaml"))
for feature in (values["agentTokens"], values["podWatch"], values["stacks"]["rbac"]):
    feature["namespaces"] = [train]
values["image"] = {"repository": os.environ["IMAGE_REPOSITORY"], "tag": os.environ.get("IMAGE_TAG", ""),
                   "pullPolicy": os.environ.get("PULL_POLICY", "IfNotPresent")}
image = values["redis"].setdefault("image", {})
if os.environ.get("REDIS_DIGEST"):
    image["digest"] = os.environ["REDIS_DIGEST"]
else:
    image["allowTag"] = True
with helm.Config(namespace=ns) as cfg:
    print(cfg.install("helm/breakpod", release, values, wait="watcher", timeout=300)["status"])
PYTHON

pod_yaml() {  # NAME LABELLED COMMAND(YAML list) [MEMORY_LIMIT]
  local labels='{}'
  [[ "$2" == yes ]] && labels='{breakpod.dev/inject: "true"}'
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, labels: $labels}
spec:
  restartPolicy: Never
  containers:
    - name: train
      image: $TRAIN_IMAGE
      imagePullPolicy: ${PULL_POLICY:-IfNotPresent}
      command: $3
      resources: {limits: {memory: ${4:-512Mi}}}
      volumeMounts: [{name: code, mountPath: /app}]
  volumes: [{name: code, configMap: {name: e2e-scripts}}]
YAML
}
has_overlay() {
  kubectl -n "$TRAIN_NS" get pod "$1" -o jsonpath='{.spec.containers[0].env[*].name}' | grep -qw PYTHONBREAKPOINT
}

step "the webhook: a labelled pod mutated, an unlabelled one untouched"
cat > "$WORK/oom.py" <<'PYTHON'
import time, breakpod
breakpod.emit("log", message="allocating until the OOM killer comes")
time.sleep(5)  # the session is registered before the end
hog = []
while True:
    hog.append(bytearray(8 << 20))
    time.sleep(0.005)
PYTHON
kubectl -n "$TRAIN_NS" create configmap e2e-scripts --from-file=examples/train_nan.py --from-file="$WORK/oom.py"
pod_yaml labelled yes "[sleep, '600']" | kubectl -n "$TRAIN_NS" apply -f -
pod_yaml unlabelled no "[sleep, '600']" | kubectl -n "$TRAIN_NS" apply -f -
has_overlay labelled || die "the webhook did not apply the overlay to the labelled pod"
has_overlay unlabelled && die "the unlabelled pod was mutated"
echo "labelled: overlay applied; unlabelled: untouched"

step "failurePolicy Ignore: the webhook down, a labelled pod still starts"
kubectl -n "$NS" scale deployment "$FULL-webhook" --replicas=0
for _ in $(seq 60); do  # (kubectl wait --for=delete fails when none is left to wait for)
  [[ -z "$(kubectl -n "$NS" get pod -l app.kubernetes.io/component=webhook -o name)" ]] && break
  sleep 2
done
pod_yaml while-down yes "[sleep, '600']" | kubectl -n "$TRAIN_NS" apply -f -
has_overlay while-down && die "a pod was mutated with no webhook pod running"
echo "created without the overlay while the webhook was down"
kubectl -n "$NS" scale deployment "$FULL-webhook" --replicas=1
kubectl -n "$NS" rollout status deployment "$FULL-webhook" --timeout=180s

step "RBAC (SubjectAccessReview)"
sar() {  # EXPECTED USER NAMESPACE VERB RESOURCE [SUBRESOURCE]
  local got
  got=$(kubectl create -o jsonpath='{.status.allowed}' -f - <<YAML
apiVersion: authorization.k8s.io/v1
kind: SubjectAccessReview
spec:
  user: $2
  resourceAttributes: {namespace: $3, verb: $4, resource: $5, subresource: "${6:-}"}
YAML
)
  [[ "${got:-false}" == "$1" ]] || die "SubjectAccessReview: $2 $4 $5${6:+/$6} in $3 is ${got:-false}, expected $1"
  echo "  $2: $4 $5${6:+/$6} in $3 -> $1"
}
BROKER_SA="system:serviceaccount:$NS:$FULL"
STACKS_SA="system:serviceaccount:$NS:$FULL-stacks"
sar true "$BROKER_SA" "$TRAIN_NS" watch pods
sar true "$BROKER_SA" "$TRAIN_NS" list pods
sar false "$BROKER_SA" "$TRAIN_NS" delete pods
sar false "$BROKER_SA" "$TRAIN_NS" get secrets
sar false "$BROKER_SA" default watch pods
sar true "$STACKS_SA" "$TRAIN_NS" create pods exec
sar true "$STACKS_SA" "$TRAIN_NS" patch pods ephemeralcontainers
sar false "$STACKS_SA" "$TRAIN_NS" delete pods
sar false "$STACKS_SA" default create pods exec

step "helm test"
"$PY" - "$RELEASE" "$NS" <<'PYTHON'
import sys, helm_python as helm
with helm.Config(namespace=sys.argv[2]) as cfg:
    result = cfg.test(sys.argv[1], timeout=180, logs=True)
print(result.get("logs", "").strip() or "helm test: passed")
PYTHON

step "the broker, through port-forward"
kubectl -n "$NS" port-forward "svc/$FULL" 18765:8765 >/dev/null &
PF_PID=$!
export BREAKPOD_BROKER_URL=http://127.0.0.1:18765
BREAKPOD_BROKER_TOKEN=$(kubectl -n "$NS" get secret "$FULL" -o jsonpath='{.data.viewer-token}' | base64 -d)
export BREAKPOD_BROKER_TOKEN
for _ in $(seq 30); do "${BREAKPOD[@]}" sessions >/dev/null 2>&1 && break; sleep 1; done

session_of() {  # POD FIELD: a field of the newest session of that pod, empty if none
  "${BREAKPOD[@]}" sessions --json 2>/dev/null | "$PY" -c '
import json, sys
found = [s for s in json.load(sys.stdin) if s.get("pod") == sys.argv[1]]
found.sort(key=lambda s: s["created"])
print(json.dumps(found[-1].get(sys.argv[2])) if found else "")
' "$1" "$2" || true
}

step "an OOM-killed pod is reported with its reason"
pod_yaml oom yes "[python, /app/oom.py]" 128Mi | kubectl -n "$TRAIN_NS" apply -f -
reason=""
for _ in $(seq 90); do
  reason="$(session_of oom state) $(session_of oom reason)"
  grep -q OOMKilled <<<"$reason" && break
  sleep 2
done
grep -q OOMKilled <<<"$reason" || die "the session of pod oom does not say OOMKilled: $reason"
echo "oom: $reason"

step "a parked training pod: breakpod stacks pod/NAME, then breakpod attach"
pod_yaml parked yes "[python, /app/train_nan.py]" | kubectl -n "$TRAIN_NS" apply -f -
kubectl -n "$TRAIN_NS" wait --for=condition=Ready pod/parked --timeout=300s
for _ in $(seq 90); do
  kubectl -n "$TRAIN_NS" logs parked | grep -q "for a debugger on" && break
  sleep 2
done
timeout 120 "${BREAKPOD[@]}" stacks pod/parked -n "$TRAIN_NS" | tee "$WORK/stacks.txt"
grep -q "train_nan.py" "$WORK/stacks.txt" || die "stacks pod/parked did not show the training loop"
SESSION=$(session_of parked id | tr -d '"')
[[ -n "$SESSION" ]] || die "no session for pod parked"
printf 'p loss\nc\n' | timeout 120 "${BREAKPOD[@]}" attach "$SESSION"
kubectl -n "$TRAIN_NS" wait --for=jsonpath='{.status.phase}'=Succeeded pod/parked --timeout=180s
echo "e2e-cluster: OK"
