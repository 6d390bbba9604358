"""The manifests' admission rules and network policies, checked by evaluating them:
the webhook's matchConditions and the scheduler's ValidatingAdmissionPolicy run
in a real CEL interpreter (cel-python) against pods, and the NetworkPolicies are
read against the pods they select."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import celpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice_common.config import RequestSettings
from gpuslice_common.devicetypes import with_vendors
from gpuslice_common.dra import API_VERSION as DRA_API_VERSION
from gpuslice_common.dra import DEVICE_CLASS
from gpuslice_common.dra import DRIVER as DRA_DRIVER
from gpuslice_common.models import PLACEMENT_ANNOTATION
from gpuslice_common.requests import has_gpu_request, parse_pod
from gpuslice_deviceplugin.dra.slices import slice_name
from gpuslice_webhook.claims import MANAGED_BY, NAME_PREFIX, claim_template
from tests.deploy.kustomize import overlay, render

ROOT = Path(__file__).resolve().parents[2]
OBJECTS = render(ROOT / "k8s")


def _with_cpu_pods() -> list[dict[str, Any]]:
    """k8s/ with the component that routes pods without GPUs (k8s/cpu-pods)."""
    with tempfile.TemporaryDirectory() as directory:
        return render(overlay(Path(directory), ROOT / "k8s", "cpu-pods"))


CPU_PODS_OBJECTS = _with_cpu_pods()
SCHEDULER_SA = "system:serviceaccount:gpuslice:gpuslice-scheduler"


def find(kind: str, name: str) -> dict[str, Any]:
    for obj in OBJECTS:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name}")


def program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def run(prog: Any, **values: Any) -> bool:
    result = prog.evaluate({k: celpy.json_to_cel(v) for k, v in values.items()})
    assert isinstance(result, celpy.celtypes.BoolType), result
    return bool(result)


# ---------------------------------------------------------------- webhook


def match_condition() -> Any:
    (hook,) = find("MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    (condition,) = hook["matchConditions"]
    return program(condition["expression"])


MATCH = match_condition()
NAMES = sorted(RequestSettings().resources.all())
OTHER = ["cpu", "memory", "nvidia.com/mig-1g.5gb", "example.com/gpu", "nvidia.com/gpux"]
amounts = st.dictionaries(st.sampled_from(NAMES + OTHER), st.sampled_from(["0", "1", "4000"]))
resources = st.fixed_dictionaries({}, optional={"limits": amounts, "requests": amounts})
containers = st.lists(
    st.fixed_dictionaries({"name": st.just("c")}, optional={"resources": resources}),
    min_size=1,
    max_size=3,
)
pods = st.fixed_dictionaries(
    {
        "spec": st.fixed_dictionaries(
            {"containers": containers}, optional={"initContainers": containers}
        )
    }
)


def test_the_match_condition_names_every_resource_the_webhook_reads() -> None:
    (hook,) = find("MutatingWebhookConfiguration", "gpuslice")["webhooks"]
    expression = hook["matchConditions"][0]["expression"]
    assert all(f'"{name}"' in expression for name in NAMES)


@settings(max_examples=300, deadline=None)
@given(pod=pods)
def test_the_match_condition_agrees_with_the_webhook_s_own_check(pod: dict[str, Any]) -> None:
    assert run(MATCH, object=pod) == has_gpu_request(pod)


def test_hami_s_example_pods_are_sent_and_others_are_not() -> None:
    gpu_pod = {
        "spec": {
            "containers": [
                {
                    "name": "ubuntu-container",
                    "resources": {"limits": {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 3000}},
                }
            ]
        }
    }
    plain = {"spec": {"containers": [{"name": "web", "resources": {"limits": {"cpu": "1"}}}]}}
    bare = {"spec": {"containers": [{"name": "web"}]}}
    init_only = {
        "spec": {
            "containers": [{"name": "web"}],
            "initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": "1"}}}],
        }
    }
    assert run(MATCH, object=gpu_pod)
    assert run(MATCH, object=init_only)
    assert not run(MATCH, object=plain)
    assert not run(MATCH, object=bare)


# ---------------------------------------------------------------- pods without GPUs
# With k8s/cpu-pods the webhook has a second entry, cpu-pods.gpuslice.io, for
# the pods the first one does not send: every pod created reaches the webhook
# through exactly one of them (outside kube-system and gpuslice).


def entries() -> tuple[dict[str, Any], dict[str, Any]]:
    for obj in CPU_PODS_OBJECTS:
        if obj["kind"] == "MutatingWebhookConfiguration" and obj["metadata"]["name"] == "gpuslice":
            gpu, cpu = obj["webhooks"]
            return gpu, cpu
    raise AssertionError("no MutatingWebhookConfiguration gpuslice")


GPU_ENTRY, CPU_ENTRY = entries()
(CPU_CONDITION,) = CPU_ENTRY["matchConditions"]
CPU_MATCH = program(CPU_CONDITION["expression"])


def test_the_cpu_entry_s_condition_is_the_gpu_entry_s_negated() -> None:
    (gpu_condition,) = GPU_ENTRY["matchConditions"]
    assert gpu_condition["name"] == "names-a-gpu-resource"
    assert CPU_CONDITION["name"] == "names-no-gpu-resource"
    # the same parse tree as !(first), whatever the layout
    env = celpy.Environment()
    negated = env.compile("!(" + gpu_condition["expression"] + ")")
    assert env.compile(CPU_CONDITION["expression"]) == negated
    assert CPU_ENTRY["failurePolicy"] == "Ignore"


def test_the_conditions_list_exactly_the_resources_the_webhook_reads() -> None:
    # HAMi's five names, each in the limits and the requests of containers and
    # init containers; renamed ones (GPUSLICE_REQUESTS__RESOURCES__*) go here too
    listed = '["' + '", "'.join(RequestSettings().resources.all()) + '"]'
    for entry in (GPU_ENTRY, CPU_ENTRY):
        expression = entry["matchConditions"][0]["expression"]
        assert expression.count(listed) == 4
        assert expression.count("[") == 4


@settings(max_examples=300, deadline=None)
@given(pod=pods)
def test_every_pod_is_sent_through_exactly_one_entry(pod: dict[str, Any]) -> None:
    gpu = run(MATCH, object=pod)
    assert run(CPU_MATCH, object=pod) is not gpu
    assert gpu == has_gpu_request(pod)


def container(name: str, **resources: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "resources": resources}


SAMPLES = {
    # GPU pods: whole cards, and HAMi's shares without nvidia.com/gpu (the
    # webhook adds the default count)
    "whole card": [container("c", limits={"nvidia.com/gpu": "1"})],
    "gpu in requests": [container("c", requests={"nvidia.com/gpu": "2"})],
    "gpumem": [container("c", limits={"nvidia.com/gpumem": "3000"})],
    "gpumem-percentage": [container("c", limits={"nvidia.com/gpumem-percentage": "50"})],
    "gpucores": [container("c", limits={"nvidia.com/gpucores": "30", "cpu": "1"})],
    "priority": [container("c", limits={"nvidia.com/priority": "0"})],
    "gpu: 0": [container("c", limits={"nvidia.com/gpu": "0"})],  # the webhook decides
    "second container": [container("a"), container("b", limits={"nvidia.com/gpu": "1"})],
    # pods without GPUs
    "no resources": [{"name": "c"}],
    "empty resources": [container("c")],
    "cpu only": [container("c", requests={"cpu": "500m"}, limits={"cpu": "1"})],
    "cpu and memory": [container("c", limits={"cpu": "1", "memory": "1Gi"})],
    "another vendor": [container("c", limits={"amd.com/gpu": "1"})],
    "a MIG profile": [container("c", limits={"nvidia.com/mig-1g.5gb": "1"})],
    "storage": [container("c", limits={"ephemeral-storage": "1Gi", "hugepages-2Mi": "2Mi"})],
}
GPU_SAMPLES = {
    "whole card",
    "gpu in requests",
    "gpumem",
    "gpumem-percentage",
    "gpucores",
    "priority",
    "gpu: 0",
    "second container",
}
INIT_SAMPLES = {
    # a GPU in an init container (a sidecar too) makes a GPU pod
    "gpu init container": (
        [container("i", limits={"nvidia.com/gpumem": "1000"})],
        [container("c", limits={"cpu": "1"})],
        True,
    ),
    "gpu sidecar": (
        [{**container("s", limits={"nvidia.com/gpu": "1"}), "restartPolicy": "Always"}],
        [{"name": "c"}],
        True,
    ),
    "cpu init container": (
        [container("i", requests={"cpu": "100m"})],
        [container("c", limits={"cpu": "1"})],
        False,
    ),
    "no init containers": ([], [{"name": "c"}], False),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_pods_are_sent_through_the_entry_for_their_kind(name: str) -> None:
    pod = {"spec": {"containers": SAMPLES[name]}}
    expected = name in GPU_SAMPLES
    assert (run(MATCH, object=pod), run(CPU_MATCH, object=pod)) == (expected, not expected)
    assert has_gpu_request(pod) is expected


@pytest.mark.parametrize("name", sorted(INIT_SAMPLES))
def test_init_containers_count_for_the_entry(name: str) -> None:
    init, containers, expected = INIT_SAMPLES[name]
    pod = {"spec": {"initContainers": init, "containers": containers}}
    assert (run(MATCH, object=pod), run(CPU_MATCH, object=pod)) == (expected, not expected)
    assert has_gpu_request(pod) is expected


def admits(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A webhook's label selector (matchLabels, matchExpressions) against ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise AssertionError(f"not a selector operator: {operator}")
    return True


def called(pod: dict[str, Any], namespace: str, labels: dict[str, str]) -> list[str]:
    """The entries the API server calls the webhook through for ``pod`` created
    in ``namespace`` (whose labels the API server completes with its name)."""
    labels = {**labels, "kubernetes.io/metadata.name": namespace}
    pod_labels = pod.get("metadata", {}).get("labels") or {}
    return [
        entry["name"]
        for entry, match in ((GPU_ENTRY, MATCH), (CPU_ENTRY, CPU_MATCH))
        if admits(entry["namespaceSelector"], labels)
        and admits(entry["objectSelector"], pod_labels)
        and run(match, object=pod)
    ]


def test_pods_in_kube_system_gpuslice_and_ignored_namespaces_are_never_routed() -> None:
    gpuslice_labels = next(
        o["metadata"]["labels"]
        for o in CPU_PODS_OBJECTS
        if o["kind"] == "Namespace" and o["metadata"]["name"] == "gpuslice"
    )
    gpu_pod = {"spec": {"containers": SAMPLES["whole card"]}}
    cpu_pod = {"spec": {"containers": SAMPLES["cpu only"]}}
    ignored_pod = {"metadata": {"labels": {"hami.io/webhook": "ignore"}}, **cpu_pod}
    assert called(gpu_pod, "team-a", {}) == ["pods.gpuslice.io"]
    assert called(cpu_pod, "team-a", {}) == ["cpu-pods.gpuslice.io"]
    assert called(ignored_pod, "team-a", {}) == []
    assert called(cpu_pod, "kube-system", {}) == []
    assert called(gpu_pod, "kube-system", {}) == ["pods.gpuslice.io"]  # as without the component
    assert called(cpu_pod, "gpuslice", gpuslice_labels) == []
    assert called(cpu_pod, "gpuslice", {}) == []  # even without its label
    for label in ("hami.io/webhook", "gpuslice.io/webhook"):
        assert called(cpu_pod, "team-b", {label: "ignore"}) == []
        assert called(gpu_pod, "team-b", {label: "ignore"}) == []


# ---------------------------------------------------------------- other vendors
# With k8s/vendors the condition names every vendor resource of the device
# configuration too (with k8s/cpu-pods, through k8s/vendors/cpu-pods, both
# entries): the webhook is sent exactly the pods it reads as GPU pods.


def _with_vendors(*components: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        return render(overlay(Path(directory), ROOT / "k8s", *components))


def _conditions(objects: list[dict[str, Any]]) -> list[Any]:
    for obj in objects:
        if obj["kind"] == "MutatingWebhookConfiguration" and obj["metadata"]["name"] == "gpuslice":
            return [program(e["matchConditions"][0]["expression"]) for e in obj["webhooks"]]
    raise AssertionError("no MutatingWebhookConfiguration gpuslice")


def _vendor_settings() -> RequestSettings:
    """What the webhook reads from the device configuration k8s/vendors ships."""
    objects = render(ROOT / "overlays" / "vendors")
    (config,) = [o for o in objects if o["metadata"]["name"] == "gpuslice-device-config"]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "device-config.yaml"
        path.write_text(config["data"]["device-config.yaml"])
        return with_vendors(RequestSettings(), str(path))


VENDOR_SETTINGS = _vendor_settings()
(VENDOR_MATCH,) = _conditions(_with_vendors("vendors"))
VENDOR_GPU_MATCH, VENDOR_CPU_MATCH = _conditions(_with_vendors("cpu-pods", "vendors/cpu-pods"))
VENDOR_NAMES = sorted(n for v in VENDOR_SETTINGS.vendors for n in v.all())
# a vendor HAMi knows whose cards gpuslice does not read (AWS Neuron), and look-alikes
NOT_READ = ["aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "hygon.com/dcu", "amd.com/gpux"]
vendor_amounts = st.dictionaries(
    st.sampled_from(NAMES + VENDOR_NAMES + OTHER + NOT_READ), st.sampled_from(["0", "1", "4000"])
)
vendor_resources = st.fixed_dictionaries(
    {}, optional={"limits": vendor_amounts, "requests": vendor_amounts}
)
vendor_containers = st.lists(
    st.fixed_dictionaries({"name": st.just("c")}, optional={"resources": vendor_resources}),
    min_size=1,
    max_size=3,
)
vendor_pods = st.fixed_dictionaries(
    {
        "spec": st.fixed_dictionaries(
            {"containers": vendor_containers}, optional={"initContainers": vendor_containers}
        )
    }
)


def test_the_device_configuration_names_many_vendors() -> None:
    vendors = {v.vendor for v in VENDOR_SETTINGS.vendors}
    assert {"hygon", "cambricon", "mthreads", "enflame", "amd", "ascend910b3"} <= vendors
    assert not set(NOT_READ) & set(VENDOR_NAMES)


# cel-python takes a tenth of a second for a list this long: fewer examples
# than above, each resource has its own case below
@settings(max_examples=100, deadline=None)
@given(pod=vendor_pods)
def test_the_vendors_condition_agrees_with_the_webhook_reading_the_device_configuration(
    pod: dict[str, Any],
) -> None:
    expected = has_gpu_request(pod, VENDOR_SETTINGS)
    assert run(VENDOR_MATCH, object=pod) == expected
    # with k8s/cpu-pods: the same, and every other pod through the second entry
    assert run(VENDOR_GPU_MATCH, object=pod) == expected
    assert run(VENDOR_CPU_MATCH, object=pod) is not expected


@pytest.mark.parametrize("name", VENDOR_NAMES)
def test_each_vendor_resource_sends_its_pod_through_the_first_entry(name: str) -> None:
    for part in ("limits", "requests"):
        pod = {"spec": {"containers": [container("c", **{part: {name: "1"}})]}}
        init = {
            "spec": {"initContainers": pod["spec"]["containers"], "containers": [{"name": "m"}]}
        }
        for sent in (pod, init):
            assert run(VENDOR_MATCH, object=sent), (name, part)
            assert (run(VENDOR_GPU_MATCH, object=sent), run(VENDOR_CPU_MATCH, object=sent)) == (
                True,
                False,
            )
            # k8s/ alone leaves them to their own scheduler
            assert not run(MATCH, object=sent)


def test_with_cpu_pods_the_second_entry_is_still_the_first_negated() -> None:
    gpu, cpu = next(
        o["webhooks"]
        for o in _with_vendors("cpu-pods", "vendors/cpu-pods")
        if o["kind"] == "MutatingWebhookConfiguration"
    )
    env = celpy.Environment()
    first = gpu["matchConditions"][0]["expression"]
    assert env.compile(cpu["matchConditions"][0]["expression"]) == env.compile(f"!({first})")


# ---------------------------------------------------------------- scheduler


def scheduler_policy() -> tuple[Any, list[tuple[str, Any]]]:
    policy = find("ValidatingAdmissionPolicy", "gpuslice-scheduler-writes-placements-only")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["UPDATE"]
    assert rule["resources"] == ["pods"]
    (condition,) = spec["matchConditions"]
    checks = [(v["message"], program(v["expression"])) for v in spec["validations"]]
    binding = find("ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    return program(condition["expression"]), checks


CONDITION, CHECKS = scheduler_policy()


def refusals(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [message for message, check in CHECKS if not run(check, object=new, oldObject=old)]


def waiting_pod() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "team-a",
            "labels": {"app": "train"},
            "annotations": {"team": "a"},
        },
        "spec": {"schedulerName": "gpuslice-scheduler", "containers": [{"name": "c"}]},
    }


def test_the_policy_applies_to_the_scheduler_s_account_only() -> None:
    request = {"userInfo": {"username": SCHEDULER_SA}}
    assert run(CONDITION, request=request)
    other = {"userInfo": {"username": "system:serviceaccount:team-a:default"}}
    assert not run(CONDITION, request=other)
    # the account is the one the scheduler's pod runs as
    deployment = find("Deployment", "gpuslice-scheduler")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert f"system:serviceaccount:gpuslice:{account}" == SCHEDULER_SA


def test_writing_the_placement_of_a_waiting_pod_is_allowed() -> None:
    old = waiting_pod()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][PLACEMENT_ANNOTATION] = '{"node": "n1"}'
    assert refusals(old, new) == []
    bare = waiting_pod()
    del bare["metadata"]["annotations"]
    first = copy.deepcopy(bare)
    first["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: "{}"}
    assert refusals(bare, first) == []


def test_writing_what_hami_s_vendor_plugins_read_at_bind_is_allowed() -> None:
    """A pod on another vendor's cards gets, beside its placement, the annotations
    HAMi's vendor plugins read at Allocate (gpuslice_scheduler.vendorannotations)."""
    from gpuslice_scheduler import vendorannotations

    old = waiting_pod()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"] |= {
        PLACEMENT_ANNOTATION: "{}",
        vendorannotations.NODE: "n1",
        vendorannotations.BIND_TIME: "1700000000",
        vendorannotations.BIND_PHASE: vendorannotations.ALLOCATING,
        "hami.io/dcu-devices-to-allocate": "DCU-0,DCU,1000,10:;",
        "hami.io/dcu-devices-allocated": "DCU-0,DCU,1000,10:;",
    }
    assert refusals(old, new) == []
    for key in (
        "hami.io/mutex.lock",
        "hami.io/dcu-devices-to-allocate-x",
        "x.io/a-devices-allocated",
        "hami.io/xpu-allocated",
        "huawei.com/vnpu-mode",
        "enflame.com/gcu-assigned-x",
    ):
        other = copy.deepcopy(new)
        other["metadata"]["annotations"][key] = "1"
        assert any("no annotation but" in m for m in refusals(old, other)), key


def every_family_s_annotations() -> dict[str, dict[str, str]]:
    """Per vendor family, what bind writes for a pod on one card of that family."""
    from gpuslice_common import drs
    from gpuslice_common.devicetypes import Rules, parse_device_config, vendor_requests
    from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
    from gpuslice_scheduler.cluster import CardFacts
    from gpuslice_scheduler.vendorannotations import vendor_annotations

    config = ROOT / "tests" / "data" / "hami-device-config.yaml"
    vendors = {Rules(v.rules): v for v in vendor_requests(parse_device_config(config.read_text()))}
    table = drs.table([drs.profile("1g.8gb", "1"), drs.profile("2g.16gb", "2")])
    cards = {"card-0": CardFacts(0, drs.model_of(table, "0"))}
    spec = {"spec": {"containers": [{"name": "c"}]}}
    out = {}
    for rules, vendor in vendors.items():
        grant = DeviceGrant(uuid="card-0", memory_mib=8192, cores=50)
        container = ContainerAssignment(name="c", devices=(grant,), vendor=vendor.vendor)
        placement = Placement(pod=PodRef(uid="u"), node="n1", containers=(container,))
        out[rules.value] = vendor_annotations(spec, placement, (vendor,), cards, 10**18)
    assert set(out) == {r.value for r in Rules}
    return out


@pytest.mark.parametrize("family", sorted(every_family_s_annotations()))
def test_what_bind_writes_for_every_vendor_family_is_allowed(family: str) -> None:
    written = every_family_s_annotations()[family]
    old = waiting_pod()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"] |= {PLACEMENT_ANNOTATION: "{}"} | written
    assert refusals(old, new) == []
    assert len(written) > 3  # the common three and the family's own


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        (lambda p: p["metadata"]["annotations"].update(team="b"), "no annotation but"),
        (lambda p: p["metadata"]["annotations"].pop("team"), "no annotation but"),
        (lambda p: p["metadata"]["annotations"].update({"x.io/y": "1"}), "no annotation but"),
        (lambda p: p["metadata"]["labels"].update(app="mine"), "labels or finalizers"),
        (lambda p: p["metadata"].update(finalizers=["hold"]), "labels or finalizers"),
        (lambda p: p["spec"]["containers"].append({"name": "x"}), "spec"),
        (lambda p: p["spec"].update(schedulerName="default-scheduler"), "only the pods it places"),
    ],
)
def test_anything_else_is_refused(change: Any, refused: str) -> None:
    old = waiting_pod()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][PLACEMENT_ANNOTATION] = "{}"
    change(new)
    messages = refusals(old, new)
    assert any(refused in m for m in messages), messages


def test_a_bound_pod_s_placement_cannot_be_rewritten() -> None:
    old = waiting_pod()
    old["spec"]["nodeName"] = "n1"
    old["metadata"]["annotations"][PLACEMENT_ANNOTATION] = '{"node": "n1"}'
    new = copy.deepcopy(old)
    new["metadata"]["annotations"][PLACEMENT_ANNOTATION] = '{"node": "n2"}'
    assert any("once it is bound" in m for m in refusals(old, new))


def placement_guard() -> tuple[Any, list[tuple[str, Any]]]:
    policy = find("ValidatingAdmissionPolicy", "gpuslice-placements-by-the-scheduler-only")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["operations"], rule["resources"]) == (["UPDATE"], ["pods"])
    binding = find("ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
    assert binding["spec"]["validationActions"] == ["Deny"]
    (condition,) = spec["matchConditions"]
    checks = [(v["message"], program(v["expression"])) for v in spec["validations"]]
    return program(condition["expression"]), checks


def test_only_the_scheduler_writes_a_pod_s_placement() -> None:
    """The reconciliation restores a bound pod's reservation from this annotation
    when the ledger lacks it: a tenant who wrote one on its own running pod (its
    UID is known once the pod exists) would book cards, or MIG slices, it was never
    given, at the next pass."""
    guard, checks = placement_guard()
    assert not run(guard, request={"userInfo": {"username": SCHEDULER_SA}})
    assert run(guard, request={"userInfo": {"username": "system:serviceaccount:team-a:default"}})

    def refused(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
        return [m for m, check in checks if not run(check, object=new, oldObject=old)]

    running = waiting_pod()
    running["spec"]["nodeName"] = "n1"
    forged = copy.deepcopy(running)
    forged["metadata"]["annotations"][PLACEMENT_ANNOTATION] = '{"node": "n1"}'
    assert any("gpuslice.io/placement" in m for m in refused(running, forged))
    bare = copy.deepcopy(running)
    del bare["metadata"]["annotations"]
    first = copy.deepcopy(bare)
    first["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: "{}"}
    assert refused(bare, first)
    placed = copy.deepcopy(forged)
    changed = copy.deepcopy(placed)
    changed["metadata"]["annotations"][PLACEMENT_ANNOTATION] = '{"node": "n1", "more": 1}'
    assert refused(placed, changed)
    removed = copy.deepcopy(placed)
    del removed["metadata"]["annotations"][PLACEMENT_ANNOTATION]
    assert refused(placed, removed)
    # anything else a tenant or a controller changes on its pod passes
    relabelled = copy.deepcopy(placed)
    relabelled["metadata"]["labels"]["app"] = "other"
    relabelled["metadata"]["annotations"]["team"] = "b"
    assert refused(placed, relabelled) == []
    assert refused(running, bare) == []


VGPU_NODE = "hami.io/vgpu-node"


def test_only_the_scheduler_names_a_pod_s_node_for_hami_s_vendor_plugins() -> None:
    """HAMi's vendor plugins, at Allocate, take the devices of a pending pod on
    their node whose hami.io/vgpu-node names the node (gpuslice writes it at bind).
    A tenant's pod started with spec.nodeName (no GPU resource: the webhook never
    sees it), kept pending and carrying that annotation with cards of its choosing,
    could be taken instead of the pod being admitted, which would get those cards
    and limits."""
    policy = find("ValidatingAdmissionPolicy", "gpuslice-hami-node-by-the-scheduler-only")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (sorted(rule["operations"]), rule["resources"]) == (["CREATE", "UPDATE"], ["pods"])
    binding = find("ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
    assert binding["spec"]["validationActions"] == ["Deny"]
    (condition,) = spec["matchConditions"]
    guard = program(condition["expression"])
    assert not run(guard, request={"userInfo": {"username": SCHEDULER_SA}})
    assert run(guard, request={"userInfo": {"username": "system:serviceaccount:team-a:default"}})
    checks = [program(v["expression"]) for v in spec["validations"]]

    def allowed(operation: str, new: dict[str, Any], old: dict[str, Any] | None) -> bool:
        return all(
            run(check, request={"operation": operation}, object=new, oldObject=old)
            for check in checks
        )

    decoy = waiting_pod()
    decoy["spec"]["nodeName"] = "n1"
    assert allowed("CREATE", decoy, None)
    forged = copy.deepcopy(decoy)
    forged["metadata"]["annotations"][VGPU_NODE] = "n1"
    assert not allowed("CREATE", forged, None)
    assert not allowed("UPDATE", forged, decoy)  # added
    bare = copy.deepcopy(decoy)
    del bare["metadata"]["annotations"]
    assert allowed("CREATE", bare, None)
    first = copy.deepcopy(bare)
    first["metadata"]["annotations"] = {VGPU_NODE: "n1"}
    assert not allowed("UPDATE", first, bare)
    moved = copy.deepcopy(forged)
    moved["metadata"]["annotations"][VGPU_NODE] = "n2"
    assert not allowed("UPDATE", moved, forged)  # changed
    assert not allowed("UPDATE", decoy, forged)  # removed
    # what HAMi's plugins change after the scheduler's bind, and anything else, passes
    phase = copy.deepcopy(forged)
    phase["metadata"]["annotations"]["hami.io/bind-phase"] = "success"
    phase["metadata"]["labels"]["app"] = "other"
    assert allowed("UPDATE", phase, forged)
    assert allowed("UPDATE", bare, decoy)


@pytest.mark.parametrize(
    "key",
    [
        "mthreads.com/predicate-node",
        "enflame.com/gcu-assigned",
        "CAMBRICON_DSMLU_PROFILE",
        "BAIDU_COM_DEVICE_IDX",
        "hami.io/metax-sgpu-devices-to-allocate",
        "huawei.com/Ascend910B3",
    ],
)
def test_only_the_scheduler_adds_what_vendor_plugins_read_at_allocate(key: str) -> None:
    """A decoy pod carrying what a vendor's plugin reads at Allocate (Moore Threads'
    predicate node, Enflame's assignment, ...) could be taken for the pod being
    admitted: it may neither be created with them nor have them added. The plugins
    rewrite some as they allocate: changing one already there passes."""
    policy = find("ValidatingAdmissionPolicy", "gpuslice-hami-node-by-the-scheduler-only")
    checks = [program(v["expression"]) for v in policy["spec"]["validations"]]

    def allowed(operation: str, new: dict[str, Any], old: dict[str, Any] | None) -> bool:
        return all(
            run(check, request={"operation": operation}, object=new, oldObject=old)
            for check in checks
        )

    decoy = waiting_pod()
    decoy["spec"]["nodeName"] = "n1"
    forged = copy.deepcopy(decoy)
    forged["metadata"]["annotations"][key] = "n1"
    assert not allowed("CREATE", forged, None)
    assert not allowed("UPDATE", forged, decoy)  # added
    rewritten = copy.deepcopy(forged)
    rewritten["metadata"]["annotations"][key] = "true"
    assert allowed("UPDATE", rewritten, forged)  # a plugin rewriting it
    assert allowed("UPDATE", decoy, forged)  # or removing it
    assert allowed("CREATE", decoy, None)


# ---------------------------------------------------------------- network


def policies(objects: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [o for o in (OBJECTS if objects is None else objects) if o["kind"] == "NetworkPolicy"]


def pod_templates() -> dict[str, dict[str, Any]]:
    out = {}
    for obj in OBJECTS:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            template = obj["spec"]["template"]
            out[obj["metadata"]["name"]] = template
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def allowed_ports(labels: dict[str, str], objects: list[dict[str, Any]] | None = None) -> set[int]:
    ports = set()
    for policy in policies(objects):
        if selects(policy["spec"]["podSelector"], labels):
            for rule in policy["spec"].get("ingress", []):
                ports |= {p["port"] for p in rule.get("ports", [])}
    return ports


def test_every_gpuslice_pod_denies_ingress_but_what_it_serves() -> None:
    (deny,) = [p for p in policies() if p["spec"]["podSelector"] == {}]
    assert deny["spec"]["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny["spec"]
    for name, template in pod_templates().items():
        labels = template["metadata"]["labels"]
        served = {
            port["containerPort"]
            for c in template["spec"]["containers"]
            for port in c.get("ports", [])
            # the web console listens on loopback, for kubectl port-forward
            if port.get("name") not in ("monitor", "console")
        }
        assert allowed_ports(labels) == served, name


def reaching(policy_name: str) -> dict[str, set[int]]:
    """The gpuslice pods a policy lets in, with the ports each may reach; every
    peer it names is a pod of gpuslice's namespace (no namespace, no address)."""
    (policy,) = [p for p in policies() if p["metadata"]["name"] == policy_name]
    found: dict[str, set[int]] = {}
    for rule in policy["spec"]["ingress"]:
        peers = rule["from"]
        if not all(set(peer) == {"podSelector"} for peer in peers):
            continue
        for name, template in pod_templates().items():
            if any(selects(peer["podSelector"], template["metadata"]["labels"]) for peer in peers):
                found.setdefault(name, set()).update(p["port"] for p in rule["ports"])
    return found


def test_only_the_extender_and_the_inventory_reach_redis() -> None:
    (policy,) = [p for p in policies() if p["metadata"]["name"] == "gpuslice-redis"]
    for rule in policy["spec"]["ingress"]:
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])
    # the ledger and the sentinels that name its primary; replication and the
    # sentinels' own talk between the members
    assert reaching("gpuslice-redis") == {
        "gpuslice-scheduler": {6379, 26379},
        "gpuslice-inventory": {6379, 26379},
        "gpuslice-redis": {6379, 26379},
    }


def test_only_nats_members_reach_the_route_port() -> None:
    (policy,) = [p for p in policies() if p["metadata"]["name"] == "gpuslice-nats"]
    route_rules = [
        rule for rule in policy["spec"]["ingress"] if {p["port"] for p in rule["ports"]} & {6222}
    ]
    (rule,) = route_rules
    assert [p["port"] for p in rule["ports"]] == [6222]
    assert reaching("gpuslice-nats") == {"gpuslice-nats": {6222}}


def test_the_console_port_is_reachable_from_nowhere_unless_tokens_are_asked_for() -> None:
    inventory = pod_templates()["gpuslice-inventory"]["metadata"]["labels"]
    assert 8090 not in allowed_ports(inventory)
    reviewed = render(ROOT / "overlays" / "console-tokenreview")
    assert allowed_ports(inventory, reviewed) == {9090, 8090}
    (rule,) = [
        rule
        for policy in policies(reviewed)
        for rule in policy["spec"].get("ingress", [])
        if {p["port"] for p in rule["ports"]} == {8090}
    ]
    # from labelled namespaces only: no address block, no bare namespace selector
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"gpuslice.io/console": "true"}}}]


# ---------------------------------------------------------------- GPU pods through gpuslice


def gpu_pods_policy() -> tuple[Any, list[tuple[str, Any]]]:
    policy = find("ValidatingAdmissionPolicy", "gpuslice-gpu-pods-through-gpuslice")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert (rule["operations"], rule["resources"]) == (["CREATE"], ["pods"])
    binding = find("ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
    assert binding["spec"]["validationActions"] == ["Deny"]
    (condition,) = spec["matchConditions"]
    checks = [(v["message"], program(v["expression"])) for v in spec["validations"]]
    return program(condition["expression"]), checks


GPU_CONDITION, GPU_CHECKS = gpu_pods_policy()


def gpu_pod_refusals(pod: dict[str, Any], namespace_labels: dict[str, str]) -> list[str] | None:
    """None where the policy does not apply, else the messages it refuses with."""
    if not run(GPU_CONDITION, object=pod):
        return None
    namespace: dict[str, Any] = {"metadata": {"name": "team-a"}}
    if namespace_labels:
        namespace["metadata"]["labels"] = namespace_labels
    return [m for m, check in GPU_CHECKS if not run(check, object=pod, namespaceObject=namespace)]


def asking(resource: str = "nvidia.com/gpu", *, init: bool = False) -> dict[str, Any]:
    container = {"name": "c", "resources": {"limits": {resource: "1"}}}
    spec: dict[str, Any] = {"containers": [container]}
    if init:
        spec = {"containers": [{"name": "main"}], "initContainers": [container]}
    return {"metadata": {"name": "p", "namespace": "team-a"}, "spec": spec}


def test_a_gpu_pod_placed_by_gpuslice_passes() -> None:
    pod = asking()
    pod["spec"]["schedulerName"] = "gpuslice-scheduler"
    assert gpu_pod_refusals(pod, {}) == []
    assert gpu_pod_refusals(pod, {"team": "a"}) == []


def test_gpu_pods_that_would_skip_gpuslice_are_refused() -> None:
    """Kubelet's Allocate names no pod: a GPU pod gpuslice never placed would
    take the grant of the pod the node waits for."""
    for label in ("gpuslice.io/webhook", "hami.io/webhook"):
        labelled = asking()
        labelled["metadata"]["labels"] = {label: "ignore", "app": "x"}
        assert gpu_pod_refusals(labelled, {}) == [
            "a pod that asks for nvidia.com/gpu must go through gpuslice's webhook; "
            "remove the label webhook=ignore"
        ]
        [why] = gpu_pod_refusals(asking(init=True), {label: "ignore"}) or ["none"]
        assert "namespace labelled webhook=ignore" in why
    placed = asking()
    placed["spec"]["nodeName"] = "gpu-1"
    [why] = gpu_pod_refusals(placed, {}) or ["none"]
    assert "cannot set spec.nodeName" in why


def test_pods_without_nvidia_gpus_are_not_concerned() -> None:
    for resource in ("cpu", "nvidia.com/mig-3g.20gb", "nvidia.com/gpumem"):
        pod = asking(resource)
        pod["metadata"]["labels"] = {"gpuslice.io/webhook": "ignore"}
        pod["spec"]["nodeName"] = "gpu-1"
        assert gpu_pod_refusals(pod, {"gpuslice.io/webhook": "ignore"}) is None


# ---------------------------------------------------------------- DRA: each agent its own slice


def _with_dra() -> list[dict[str, Any]]:
    return render(ROOT / "overlays" / "dra")


DRA_OBJECTS = _with_dra()
AGENT_SA = "system:serviceaccount:gpuslice:gpuslice-deviceplugin"
NODE_KEY = "authentication.kubernetes.io/node-name"


def slice_policy() -> tuple[Any, Any, list[tuple[str, Any]]]:
    (policy,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "ValidatingAdmissionPolicy"
        and o["metadata"]["name"] == "gpuslice-agent-writes-its-own-slice"
    ]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"]
    (binding,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "ValidatingAdmissionPolicyBinding"
        and o["spec"]["policyName"] == policy["metadata"]["name"]
    ]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (condition,) = spec["matchConditions"]
    (variable,) = spec["variables"]
    assert variable["name"] == "node"
    checks = [(v["message"], program(v["expression"])) for v in spec["validations"]]
    return program(condition["expression"]), program(variable["expression"]), checks


SLICE_CONDITION, SLICE_NODE, SLICE_CHECKS = slice_policy()


def resource_slice(
    node: str, *, pool: str | None = None, driver: str = DRA_DRIVER, name: str | None = None
) -> Any:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or slice_name(node)},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def slice_refusals(
    operation: str, new: Any, old: Any, *, user: str = AGENT_SA, node: str | None = "gpu-1"
) -> list[str] | None:
    """None where the policy does not apply, else the messages it refuses with."""
    user_info: dict[str, Any] = {"username": user}
    if node is not None:
        user_info["extra"] = {NODE_KEY: [node], "authentication.kubernetes.io/pod-name": ["a"]}
    request = {"userInfo": user_info, "operation": operation}
    if not run(SLICE_CONDITION, request=request):
        return None
    values = {"request": request, "object": new, "oldObject": old}
    cel = {k: celpy.json_to_cel(v) for k, v in values.items()}
    cel["variables"] = celpy.json_to_cel({"node": str(SLICE_NODE.evaluate(cel))})
    out = []
    for message, check in SLICE_CHECKS:
        result = check.evaluate(cel)
        assert isinstance(result, celpy.celtypes.BoolType), result
        if not result:
            out.append(message)
    return out


def test_an_agent_writes_its_own_node_s_slice() -> None:
    mine = resource_slice("gpu-1")
    assert slice_refusals("CREATE", mine, None) == []
    changed = copy.deepcopy(mine)
    changed["spec"]["pool"]["generation"] = 2
    assert slice_refusals("UPDATE", changed, mine) == []
    assert slice_refusals("DELETE", None, mine) == []


def test_an_agent_cannot_touch_another_node_s_slice() -> None:
    theirs = resource_slice("gpu-2")
    assert slice_refusals("CREATE", theirs, None) == [
        "a node agent may write only its own node's slice (spec.nodeName and pool named "
        "after its node, driver gpu.gpuslice.io)",
        "a node agent names its node's slices <node>-gpu.gpuslice.io, then -1, -2 ... "
        "(at most -999)",
    ]
    assert slice_refusals("DELETE", None, theirs) == [
        "a node agent may change or delete only its own node's slice"
    ]
    # moving another node's slice to itself, or its own away
    assert len(slice_refusals("UPDATE", resource_slice("gpu-1"), theirs) or []) == 1
    moved = resource_slice("gpu-2", name=slice_name("gpu-1"))
    assert len(slice_refusals("UPDATE", moved, resource_slice("gpu-1")) or []) == 1
    # its own node name, another node's pool; another driver's slice
    assert len(slice_refusals("CREATE", resource_slice("gpu-1", pool="gpu-2"), None) or []) == 1
    other = resource_slice("gpu-1", driver="gpu.example.com")
    assert len(slice_refusals("CREATE", other, None) or []) == 1
    # a slice for all nodes (no spec.nodeName)
    everywhere = resource_slice("gpu-1")
    del everywhere["spec"]["nodeName"]
    everywhere["spec"]["allNodes"] = True
    assert len(slice_refusals("CREATE", everywhere, None) or []) == 1


def test_an_agent_token_not_bound_to_a_node_is_refused() -> None:
    why = slice_refusals("CREATE", resource_slice("gpu-1"), None, node=None) or []
    assert "the node agent must write with its pod's token, which names its node" in why
    why = slice_refusals("CREATE", resource_slice(""), None, node="") or []
    assert "the node agent must write with its pod's token, which names its node" in why


def test_the_slice_policy_leaves_other_accounts_alone() -> None:
    theirs = resource_slice("gpu-2")
    assert slice_refusals("CREATE", theirs, None, user="system:node:gpu-1") is None
    kubelet_sa = "system:serviceaccount:kube-system:some-driver"
    assert slice_refusals("DELETE", None, theirs, user=kubelet_sa) is None
    # the account is the one the agent's pods run as
    (agent,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "gpuslice-deviceplugin"
    ]
    account = agent["spec"]["template"]["spec"]["serviceAccountName"]
    assert f"system:serviceaccount:gpuslice:{account}" == AGENT_SA


def test_an_agent_names_its_slices_as_it_publishes_them() -> None:
    """<node>-gpu.gpuslice.io, then -1 ... -999 (slices.slice_name): no other name,
    so no node takes the name of another node's slice first."""
    for index in (0, 1, 2, 10, 999):
        mine = resource_slice("gpu-1", name=slice_name("gpu-1", index))
        assert slice_refusals("CREATE", mine, None) == [], index
        assert slice_refusals("UPDATE", mine, mine) == [], index
    naming = (
        "a node agent names its node's slices <node>-gpu.gpuslice.io, then -1, -2 ... "
        "(at most -999)"
    )
    for name in (
        slice_name("gpu-2"),  # another node's, its own nodeName and pool
        slice_name("gpu-10"),
        "gpu-1-gpu",
        "gpu-1",
        slice_name("gpu-1") + "-0",
        slice_name("gpu-1") + "-01",
        slice_name("gpu-1") + "-1000",
        slice_name("gpu-1") + "-1-2",
        slice_name("gpu-1") + "-x",
        slice_name("gpu-1") + "x",
        slice_name(slice_name("gpu-1", 1)),  # node gpu-1-gpu.gpuslice.io-1's slice
        "x" + slice_name("gpu-1"),
    ):
        assert slice_refusals("CREATE", resource_slice("gpu-1", name=name), None) == [naming], name
    # its node's stale slices go whatever their name
    assert slice_refusals("DELETE", None, resource_slice("gpu-1", name="old")) == []


# ---------------------------------------------------------------- DRA policies, evaluated whole

WEBHOOK_SA = "system:serviceaccount:gpuslice:gpuslice-webhook"
CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
KCM = "system:kube-controller-manager"
SCHEDULER = "system:kube-scheduler"
TENANT = "alice"
HAND_WRITTEN = "gpuslice.io/hand-written-claims"


def dra_policy(name: str) -> dict[str, Any]:
    """A ValidatingAdmissionPolicy of the DRA build, failing closed, bound to deny."""
    (policy,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == name
    ]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (binding,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "ValidatingAdmissionPolicyBinding" and o["spec"]["policyName"] == name
    ]
    assert binding["metadata"]["name"] == name
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # every namespace
    return policy


def admission(
    policy: dict[str, Any],
    operation: str,
    resource: str,
    new: Any,
    old: Any,
    *,
    user: str,
    namespace: dict[str, Any] | None = None,
) -> list[str] | None:
    """What the API server does with ``policy`` for one request: None where it
    does not apply (matchConstraints, matchConditions), else the messages of the
    validations that refuse, each evaluated with the variables before it."""
    spec = policy["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    if not any(resource in r["resources"] and operation in r["operations"] for r in rules):
        return None
    request = {
        "operation": operation,
        "userInfo": {"username": user},
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": resource},
    }
    values = {"request": request, "object": new, "oldObject": old}
    if namespace is not None:
        values["namespaceObject"] = namespace
    cel = {k: celpy.json_to_cel(v) for k, v in values.items()}
    for condition in spec.get("matchConditions", []):
        if not program(condition["expression"]).evaluate(cel):
            return None
    variables: dict[Any, Any] = {}
    for variable in spec.get("variables", []):
        cel["variables"] = celpy.celtypes.MapType(variables)
        value = program(variable["expression"]).evaluate(cel)
        assert not isinstance(value, celpy.CELEvalError), (variable["name"], value)
        variables[celpy.celtypes.StringType(variable["name"])] = value
    cel["variables"] = celpy.celtypes.MapType(variables)
    refused = []
    for validation in spec["validations"]:
        result = program(validation["expression"]).evaluate(cel)
        assert isinstance(result, celpy.celtypes.BoolType), (validation["message"], result)
        if not result:
            refused.append(" ".join(validation["message"].split()))
    return refused


# ---------------------------------------------------------------- DRA: claims through the webhook

CLAIM_POLICY = dra_policy("gpuslice-claims-through-the-webhook")
THROUGH_THE_WEBHOOK = (
    "gpuslice-claims-through-the-webhook: a claim or claim template of device class "
    "gpuslice.io is made by gpuslice's webhook"
)
WEBHOOK_S_OWN = (
    "gpuslice-claims-through-the-webhook: claim templates named gpuslice-* or labelled "
    "app.kubernetes.io/managed-by=gpuslice are gpuslice's webhook's"
)


def namespace_object(labels: dict[str, str] | None = None, *, going: bool = False) -> Any:
    metadata: dict[str, Any] = {"name": "team-a"}
    if labels:
        metadata["labels"] = {"kubernetes.io/metadata.name": "team-a", **labels}
    if going:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}


def devices(device_class: str = DEVICE_CLASS, *, first_available: bool = False) -> Any:
    if first_available:
        request = {
            "name": "gpu",
            "firstAvailable": [
                {"name": "other", "deviceClassName": "gpu.example.com"},
                {"name": "ours", "deviceClassName": device_class, "count": 8},
            ],
        }
    else:
        request = {
            "name": "gpu",
            "exactly": {
                "deviceClassName": device_class,
                "allocationMode": "ExactCount",
                "count": 8,
            },
        }
    return {"requests": [request]}


def claim(name: str = "mine", **kwargs: Any) -> Any:
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"devices": devices(**kwargs)},
    }


def template(name: str = "mine", labels: dict[str, str] | None = None, **kwargs: Any) -> Any:
    metadata: dict[str, Any] = {"name": name, "namespace": "team-a"}
    if labels:
        metadata["labels"] = labels
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": metadata,
        "spec": {"spec": {"devices": devices(**kwargs)}},
    }


def webhook_template() -> Any:
    """A template as the webhook makes it from a pod asking for half a card."""
    manifest = {
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {
            "containers": [
                {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            ]
        },
    }
    request = parse_pod(manifest)
    assert request is not None
    made = claim_template(
        request, "team-a", consumable=True, names=RequestSettings().resources
    ).body
    assert made["metadata"]["name"].startswith(NAME_PREFIX)
    assert made["metadata"]["labels"] == {MANAGED_BY[0]: MANAGED_BY[1]}
    return made


def claims_admission(
    operation: str,
    new: Any,
    old: Any = None,
    *,
    user: str = TENANT,
    namespace: Any = None,
) -> list[str] | None:
    kind = (new or old)["kind"]
    resource = {
        "ResourceClaim": "resourceclaims",
        "ResourceClaimTemplate": "resourceclaimtemplates",
    }
    return admission(
        CLAIM_POLICY,
        operation,
        resource[kind],
        new,
        old,
        user=user,
        namespace=namespace or namespace_object(),
    )


def firsts(messages: list[str] | None) -> list[str] | None:
    """Each refusal's first sentence, up to its first comma-free clause."""
    if messages is None:
        return None
    return [m.split(" from a pod")[0].split(" (the namespace")[0] for m in messages]


def test_the_claim_policy_matches_claims_and_templates_not_their_status() -> None:
    rules = CLAIM_POLICY["spec"]["matchConstraints"]["resourceRules"]
    matched = {(r, op) for rule in rules for r in rule["resources"] for op in rule["operations"]}
    assert matched == {
        ("resourceclaims", "CREATE"),
        ("resourceclaims", "UPDATE"),
        ("resourceclaimtemplates", "CREATE"),
        ("resourceclaimtemplates", "UPDATE"),
        ("resourceclaimtemplates", "DELETE"),
    }
    assert all(rule["apiGroups"] == ["resource.k8s.io"] for rule in rules)
    # kube-scheduler writes a claim's allocation through resourceclaims/status
    allocated = claim()
    allocated["status"] = {"allocation": {"devices": {"results": []}}}
    assert claims_admission("UPDATE", allocated, claim(), user=SCHEDULER) == []
    assert (
        admission(
            CLAIM_POLICY, "UPDATE", "resourceclaims/status", allocated, claim(), user=SCHEDULER
        )
        is None
    )
    # the webhook's account is the one its pods run as
    (deployment,) = [
        o
        for o in DRA_OBJECTS
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpuslice-webhook"
    ]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert f"system:serviceaccount:gpuslice:{account}" == WEBHOOK_SA


def test_a_tenant_s_own_gpuslice_claim_is_refused() -> None:
    """The reviewer's attack: a claim for 8 whole cards of class gpuslice.io,
    written by hand, outside the webhook's quota checks."""
    for shape in ({}, {"first_available": True}):
        assert firsts(claims_admission("CREATE", claim(**shape))) == [THROUGH_THE_WEBHOOK]
        assert firsts(claims_admission("CREATE", template(**shape))) == [THROUGH_THE_WEBHOOK]
        # not the webhook's to write claims, nor the claim controller's to write templates
        assert firsts(claims_admission("CREATE", claim(**shape), user=WEBHOOK_SA)) == [
            THROUGH_THE_WEBHOOK
        ]
        assert firsts(claims_admission("CREATE", template(**shape), user=CLAIM_CONTROLLER)) == [
            THROUGH_THE_WEBHOOK
        ]
    # a claim changed to ask for gpuslice's class (the API server refuses a spec
    # change anyway; the policy does not count on it)
    other = claim(device_class="gpu.example.com")
    assert firsts(claims_admission("UPDATE", claim(), other)) == [THROUGH_THE_WEBHOOK]
    other_template = template(device_class="gpu.example.com")
    assert firsts(claims_admission("UPDATE", template(), other_template)) == [THROUGH_THE_WEBHOOK]


def test_the_claim_controller_and_the_webhook_write_what_pods_ask_through_it() -> None:
    for user in (CLAIM_CONTROLLER, KCM):  # with and without per-controller credentials
        assert claims_admission("CREATE", claim(), user=user) == []
        assert claims_admission("CREATE", claim(first_available=True), user=user) == []
    made = webhook_template()
    assert claims_admission("CREATE", made, user=WEBHOOK_SA) == []
    # the claim the controller makes from it
    from_template = {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "p-gpu-x1y2z", "namespace": "team-a"},
        "spec": made["spec"]["spec"],
    }
    assert claims_admission("CREATE", from_template, user=CLAIM_CONTROLLER) == []
    assert firsts(claims_admission("CREATE", from_template)) == [THROUGH_THE_WEBHOOK]


def test_updates_that_leave_the_spec_alone_pass() -> None:
    """kube-scheduler adds its finalizer, the claim controller removes it, a
    tenant labels its claim: none writes a request."""
    old = claim()
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    for user in (SCHEDULER, CLAIM_CONTROLLER, TENANT):
        assert claims_admission("UPDATE", new, old, user=user) == []
    labelled = copy.deepcopy(old)
    labelled["metadata"]["labels"] = {"team": "a"}
    assert claims_admission("UPDATE", labelled, old) == []


def test_a_namespace_labelled_by_its_operator_writes_its_own_claims() -> None:
    allowed = namespace_object({HAND_WRITTEN: "allowed"})
    for shape in ({}, {"first_available": True}):
        assert claims_admission("CREATE", claim(**shape), namespace=allowed) == []
        assert claims_admission("CREATE", template(**shape), namespace=allowed) == []
    for value in ("true", "Allowed", "yes"):
        other = namespace_object({HAND_WRITTEN: value})
        assert firsts(claims_admission("CREATE", claim(), namespace=other)) == [THROUGH_THE_WEBHOOK]
    unlabelled = namespace_object({"team": "a"})
    assert firsts(claims_admission("CREATE", claim(), namespace=unlabelled)) == [
        THROUGH_THE_WEBHOOK
    ]


def test_claims_of_other_classes_are_not_concerned() -> None:
    for obj in (
        claim(device_class="gpu.example.com"),
        claim(device_class="gpu.example.com", first_available=True),
        template(device_class="gpu.example.com"),
        template(device_class="gpuslice.io.example"),
    ):
        assert claims_admission("CREATE", obj) == [], obj
    assert claims_admission("DELETE", None, template()) == []
    bare = claim()
    bare["spec"] = {}
    assert claims_admission("CREATE", bare) == []
    empty_template = template()
    empty_template["spec"] = {"spec": {}}
    assert claims_admission("CREATE", empty_template) == []


def test_only_the_webhook_writes_or_deletes_gpuslice_s_templates() -> None:
    """The reviewer's attack: the tenant deletes the template its running pod's
    quota is counted from (or changes it, or plants one), in any namespace."""
    made = webhook_template()
    allowed = namespace_object({HAND_WRITTEN: "allowed"})
    for namespace in (namespace_object(), allowed):
        refused = firsts(claims_admission("DELETE", None, made, namespace=namespace))
        assert refused == [WEBHOOK_S_OWN]
        assert claims_admission("DELETE", None, made, user=WEBHOOK_SA, namespace=namespace) == []
        for user in (TENANT, CLAIM_CONTROLLER, KCM):
            # unlabelled and renamed it is still gpuslice's before the change
            relabelled = copy.deepcopy(made)
            del relabelled["metadata"]["labels"]
            assert WEBHOOK_S_OWN in (
                firsts(claims_admission("UPDATE", relabelled, made, user=user, namespace=namespace))
                or []
            )
        # planted: by its name or by its label, even asking for no GPU
        for planted in (
            template(NAME_PREFIX + "0" * 24, device_class="gpu.example.com"),
            template("mine", {MANAGED_BY[0]: MANAGED_BY[1]}, device_class="gpu.example.com"),
        ):
            assert firsts(claims_admission("CREATE", planted, namespace=namespace)) == [
                WEBHOOK_S_OWN
            ]
            assert claims_admission("CREATE", planted, user=WEBHOOK_SA, namespace=namespace) == []
    # a name that only looks like it, or another manager's label, is the tenant's
    assert claims_admission("CREATE", template("my-gpuslice-1", device_class="x")) == []
    other = template("mine", {MANAGED_BY[0]: "helm"}, device_class="x")
    assert claims_admission("CREATE", other) == []


def test_the_namespace_controller_deletes_gpuslice_s_templates_with_their_namespace() -> None:
    made = webhook_template()
    going = namespace_object(going=True)
    for user in ("system:serviceaccount:kube-system:namespace-controller", KCM, TENANT):
        assert claims_admission("DELETE", None, made, user=user, namespace=going) == []
    # but nobody else changes or plants them there
    assert firsts(claims_admission("CREATE", made, namespace=going)) == [
        THROUGH_THE_WEBHOOK,
        WEBHOOK_S_OWN,
    ]


# ---------------------------------------------------------------- DRA: slices only from the agent

AGENT_ONLY = dra_policy("gpuslice-slices-only-from-the-agent")
AGENT_WRITES = (
    "gpuslice-slices-only-from-the-agent: only gpuslice's node agent "
    "(system:serviceaccount:gpuslice:gpuslice-deviceplugin) creates or changes "
    "ResourceSlices of driver gpu.gpuslice.io"
)
WHO_DELETES = (
    "gpuslice-slices-only-from-the-agent: a ResourceSlice of driver gpu.gpuslice.io is "
    "deleted by gpuslice's node agent or by the kubelet of the slice's node only"
)


def agent_only(operation: str, new: Any, old: Any, *, user: str) -> list[str] | None:
    return admission(AGENT_ONLY, operation, "resourceslices", new, old, user=user)


def test_a_kubelet_s_credentials_cannot_publish_gpuslice_s_devices() -> None:
    """The Node authorizer and NodeRestriction let system:node:gpu-1 write a
    slice naming gpu-1, of any driver."""
    mine = resource_slice("gpu-1")
    kubelet = "system:node:gpu-1"
    assert agent_only("CREATE", mine, None, user=kubelet) == [AGENT_WRITES]
    assert agent_only("UPDATE", mine, mine, user=kubelet) == [AGENT_WRITES]
    # moved away from the driver, or into it
    other = resource_slice("gpu-1", driver="gpu.example.com")
    assert agent_only("UPDATE", other, mine, user=kubelet) == [AGENT_WRITES]
    assert agent_only("UPDATE", mine, other, user=kubelet) == [AGENT_WRITES]
    for user in (TENANT, "system:serviceaccount:kube-system:some-driver", WEBHOOK_SA):
        assert agent_only("CREATE", mine, None, user=user) == [AGENT_WRITES]
        assert agent_only("DELETE", None, mine, user=user) == [WHO_DELETES]
    # another node's kubelet deletes nothing of gpu-1's
    assert agent_only("DELETE", None, mine, user="system:node:gpu-2") == [WHO_DELETES]
    assert agent_only("DELETE", None, mine, user="system:node:gpu-1x") == [WHO_DELETES]


def test_the_agent_writes_and_the_node_s_kubelet_deletes() -> None:
    """kubelet deletes its node's slices when it starts and when a driver's
    plugin goes away: that stays allowed."""
    mine = resource_slice("gpu-1")
    assert agent_only("CREATE", mine, None, user=AGENT_SA) == []
    assert agent_only("UPDATE", mine, mine, user=AGENT_SA) == []
    assert agent_only("DELETE", None, mine, user=AGENT_SA) == []
    assert agent_only("DELETE", None, mine, user="system:node:gpu-1") == []
    # without a node name only the agent deletes it
    everywhere = resource_slice("gpu-1")
    del everywhere["spec"]["nodeName"]
    assert agent_only("DELETE", None, everywhere, user="system:node:gpu-1") == [WHO_DELETES]


def test_other_drivers_slices_are_not_concerned() -> None:
    theirs = resource_slice("gpu-1", driver="gpu.example.com")
    for user in ("system:node:gpu-1", "system:serviceaccount:kube-system:some-driver", TENANT):
        assert agent_only("CREATE", theirs, None, user=user) is None
        assert agent_only("UPDATE", theirs, theirs, user=user) is None
        assert agent_only("DELETE", None, theirs, user=user) is None


# ---------------------------------------------------------------- DRA: templates with their request

POD_POLICY = dra_policy("gpuslice-templates-with-their-request")


def pod_refusals(pod: dict[str, Any]) -> list[str] | None:
    policy = copy.deepcopy(POD_POLICY)
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        assert rule["apiGroups"] == [""]
    return admission(policy, "CREATE", "pods", pod, None, user=TENANT)


def a_pod(claims: list[dict[str, Any]], **limits: str) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": dict(limits)}}]},
    }
    if claims:
        pod["spec"]["resourceClaims"] = claims
    return pod


def test_a_pod_naming_gpuslice_s_template_must_ask_for_gpus() -> None:
    """Without nvidia.com/gpu the webhook never sees the pod: it could use a
    template made for another pod's request, past the quota."""
    template = [{"name": "x", "resourceClaimTemplateName": "gpuslice-0123abcd"}]
    (refusal,) = pod_refusals(a_pod(template)) or ["not applied"]
    assert refusal.startswith("gpuslice-templates-with-their-request:")
    assert pod_refusals(a_pod(template, **{"nvidia.com/gpumem": "8000"})) == [refusal]
    # asking for GPUs: the webhook checks the template is its request's
    assert pod_refusals(a_pod(template, **{"nvidia.com/gpu": "1"})) == []
    # other templates, own claims, no claims: not this policy's
    assert pod_refusals(a_pod([{"name": "x", "resourceClaimTemplateName": "mine"}])) == []
    assert pod_refusals(a_pod([{"name": "x", "resourceClaimName": "gpuslice-0123"}])) == []
    assert pod_refusals(a_pod([])) == []


def vendor_gpu_pods_policies() -> list[tuple[Any, list[tuple[str, Any]]]]:
    found = []
    for objects in (_with_vendors("vendors"), _with_vendors("cpu-pods", "vendors/cpu-pods")):
        (policy,) = [
            o
            for o in objects
            if o["kind"] == "ValidatingAdmissionPolicy"
            and o["metadata"]["name"] == "gpuslice-gpu-pods-through-gpuslice"
        ]
        spec = policy["spec"]
        (condition,) = spec["matchConditions"]
        checks = [(v["message"], program(v["expression"])) for v in spec["validations"]]
        found.append((program(condition["expression"]), checks))
    return found


VENDOR_GPU_POLICIES = vendor_gpu_pods_policies()


@pytest.mark.parametrize("name", ["nvidia.com/gpu", *VENDOR_NAMES])
def test_with_vendors_pods_naming_a_vendor_resource_must_go_through_gpuslice(name: str) -> None:
    """A vendor's plugin, like NVIDIA's, would give a pod gpuslice never placed
    the cards of the pod the node waits for (HAMi's plugins), or cards the
    ledger counts as free (the vendors' own)."""
    for condition, checks in VENDOR_GPU_POLICIES:
        for init in (False, True):
            placed = asking(name, init=init)
            placed["spec"]["nodeName"] = "node-1"
            placed["metadata"]["labels"] = {"gpuslice.io/webhook": "ignore"}
            assert run(condition, object=placed), name
            namespace = {"metadata": {"name": "team-a"}}
            refused = [m for m, c in checks if not run(c, object=placed, namespaceObject=namespace)]
            assert refused == [
                "a pod that asks for GPUs or other accelerators must go through gpuslice's "
                "webhook; remove the label webhook=ignore",
                "a pod that asks for GPUs or other accelerators cannot set spec.nodeName, which "
                "skips scheduling; choose nodes with a nodeSelector or node affinity",
            ]
        plain = asking("cpu")
        plain["spec"]["nodeName"] = "node-1"
        assert not run(condition, object=plain)
