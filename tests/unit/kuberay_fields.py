"""The fields KubeRay's ray.io/v1 API defines, for checking rendered manifests.

Read from the json tags in ray-operator/apis/ray/v1/{rayjob,rayservice,raycluster}_types.go
of github.com/ray-project/kuberay at tag v1.7.0 (commit 59d663aeec13760646da3db9c1cf8cfe883e30b7),
and the required lists from the v1 schemas of the CRDs generated from them
(ray-operator/config/crd/bases/ray.io_{rayjobs,rayservices,rayclusters}.yaml, which agree with
the types on every field name). The types are the same on master at commit
feeaf72facab4881ba2b179248bb67315634e229. Limits from
ray-operator/controllers/ray/utils/{validation,constant}.go at the same tag.
"""

KUBERAY_VERSION = "v1.7.0"
API_VERSION = "ray.io/v1"

RAYJOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
    "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
    "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
    "ttlSecondsAfterFinished", "preRunningDeadlineSeconds", "shutdownAfterJobFinishes", "suspend",
}
# JobSubmissionMode constants (rayjob_types.go)
RAYJOB_SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}

RAYSERVICE_SPEC = {
    "rayClusterDeletionDelaySeconds", "serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold",
    "serveService", "upgradeStrategy", "managedBy", "serveConfigV2", "rayClusterConfig",
    "excludeHeadPodFromServeSvc", "suspend",
}
RAYSERVICE_REQUIRED = {"rayClusterConfig"}

RAYCLUSTER_SPEC = {
    "upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions", "headServiceAnnotations",
    "enableInTreeAutoscaling", "gcsFaultToleranceOptions", "historyServerOptions", "networkPolicy",
    "tlsOptions", "headGroupSpec", "rayVersion", "workerGroupSpecs",
}
RAYCLUSTER_REQUIRED = {"headGroupSpec"}

HEAD_GROUP_SPEC = {
    "template", "headService", "enableIngress", "ingressOptions", "resources", "labels", "rayStartParams",
    "serviceType",
}
HEAD_GROUP_REQUIRED = {"template"}

WORKER_GROUP_SPEC = {
    "suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "priority",
    "resources", "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts",
}
WORKER_GROUP_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "template"}

# rayStartParams keys that may not be combined with a group's `resources` field
# (validateRayGroupResources).
RAY_START_RESOURCE_PARAMS = {"num-cpus", "num-gpus", "memory", "resources"}
# RayJob and RayService names: DNS-1035 labels of at most MaxRayClusterNameLength - 6.
MAX_NAME_LENGTH = 47
