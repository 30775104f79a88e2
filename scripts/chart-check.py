"""Render deploy/helm/turnstile with Helm's own engine and validate every manifest against the
Kubernetes schemas, as CI runs it (scripts/test). Exits non-zero on the first thing that does
not hold.

Helm's engine comes from helm-python-sdk (Helm v4's Go SDK behind a C ABI, from PyPI: no helm
binary can be downloaded here); the schemas from kubernetes-validate (from PyPI, schemas
shipped in the package). Both pinned in scripts/test.

Beyond schema validity it checks what docs/operating.md, "Deploying", promises of the chart:
N replicas, the config in a ConfigMap, every secret by reference, probes on the health routes,
a grace period longer than the drain, a PodDisruptionBudget, the scrape annotations, and that
a chart without a tenant refuses to render.
"""

import hashlib
import sys
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "turnstile"
KUBERNETES_VERSION = "1.33.0"

failures = []


def check(condition, what):
    if not condition:
        failures.append(what)


def render(values):
    chart = helm.Chart.load(str(CHART))
    rendered = chart.render(values, name="gw", namespace="llm")
    documents = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".yaml"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                documents.append(document)
    return documents


def validate(documents, label):
    for document in documents:
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            failures.append(f"{label}: {document['kind']} {document['metadata']['name']}: {error.message}")


def by_kind(documents):
    return {document["kind"]: document for document in documents}


lint = helm.lint(str(CHART))
check(not lint["errors"], f"helm lint: {lint}")

defaults = render({})
validate(defaults, "defaults")
kinds = by_kind(defaults)
check(set(kinds) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}, f"kinds: {sorted(kinds)}")
deployment = kinds["Deployment"]
spec = deployment["spec"]["template"]["spec"]
container = spec["containers"][0]
check(deployment["spec"]["replicas"] == 3, "three replicas by default")
check(container["livenessProbe"]["httpGet"]["path"] == "/livez", "liveness on /livez")
check(container["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness on /readyz")
check(container["startupProbe"]["httpGet"]["path"] == "/healthz", "start-up on /healthz")
check(spec["terminationGracePeriodSeconds"] > 120, "grace period longer than the 120 s drain")
check(spec["securityContext"]["runAsNonRoot"] is True, "non-root")
annotations = deployment["spec"]["template"]["metadata"]["annotations"]
check(annotations.get("prometheus.io/scrape") == "true", "scrape annotation")
check(annotations.get("prometheus.io/path") == "/metrics", "scrape path")
env = {item["name"]: item for item in container["env"]}
check("secretKeyRef" in env["TURNSTILE_STORE"]["valueFrom"], "the store URL from a Secret")

def env_name(prefix, name):
    """The chart's variable name: the name made a variable name, then 8 hex of its SHA-256."""
    cleaned = name.upper().replace("-", "_").replace(".", "_")
    return f"{prefix}_{cleaned}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


default_token = env_name("TURNSTILE_TENANT_TOKEN", "default")
check(default_token in env and "secretKeyRef" in env[default_token]["valueFrom"], f"the token from a Secret: {sorted(env)}")
config = kinds["ConfigMap"]["data"]["turnstile.toml"]
check(f'token_env = "{default_token}"' in config, f"token_env in the config: {config}")
check('listen = "0.0.0.0:8080"' in config, "listens on every address")
check("drain_timeout_ms = 120000" in config, "the drain in the config")
check(kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1, "PDB")

two = render(
    {
        "replicaCount": 2,
        "drainTimeoutMs": 600000,
        "tenants": [{"name": "acme-eu", "tokenSecret": {"name": "t", "key": "acme"}}],
        "providers": {"openai": {"baseUrl": "https://api.openai.com", "apiKeySecret": {"name": "p", "key": "openai"}}},
        "extraTables": '[[routes]]\napi = "openai-chat"\nprovider = "openai"\nadapter = "openai-chat@2"\n',
    }
)
validate(two, "two replicas, a provider")
kinds = by_kind(two)
spec = kinds["Deployment"]["spec"]["template"]["spec"]
check(kinds["Deployment"]["spec"]["replicas"] == 2, "replicaCount")
check(spec["terminationGracePeriodSeconds"] == 615, f"grace {spec['terminationGracePeriodSeconds']}")
env = {item["name"] for item in spec["containers"][0]["env"]}
check({env_name("TURNSTILE_TENANT_TOKEN", "acme-eu"), env_name("TURNSTILE_PROVIDER_KEY", "openai")} <= env, f"env {env}")
config = kinds["ConfigMap"]["data"]["turnstile.toml"]
check(f'api_key_env = "{env_name("TURNSTILE_PROVIDER_KEY", "openai")}"' in config, config)

# Names that clean up to one variable name keep their own variables (review finding: two
# tenants sharing one token variable would share one token).
similar = render(
    {
        "tenants": [
            {"name": "acme-eu", "tokenSecret": {"name": "t", "key": "a"}},
            {"name": "acme_eu", "tokenSecret": {"name": "t", "key": "b"}},
        ]
    }
)
names = [item["name"] for item in by_kind(similar)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]]
tokens = [name for name in names if name.startswith("TURNSTILE_TENANT_TOKEN")]
check(len(tokens) == 2 and len(set(tokens)) == 2, f"two tenants, two variables: {tokens}")
check(config.index("[[routes]]") > config.index("[providers.openai]"), "tables after the keys")

# The rendered TOML parses (the gateway itself refuses an unknown key at start, exit 78).
try:
    tomllib.loads(config)
except tomllib.TOMLDecodeError as error:
    failures.append(f"rendered TOML: {error}")

try:
    render({"tenants": []})
    failures.append("a chart without tenants rendered")
except Exception as error:  # Helm's template `fail`
    check("at least one tenant" in str(error), f"no-tenant refusal: {error}")

if failures:
    for failure in failures:
        print(f"chart-check: FAILED: {failure}", file=sys.stderr)
    sys.exit(1)
print(f"chart-check: rendered and valid against Kubernetes {KUBERNETES_VERSION}: {len(defaults)} + {len(two)} manifests")
