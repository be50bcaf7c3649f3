#!/usr/bin/env bash
# Produce Strimzi's CustomResourceDefinitions (Kafka, KafkaNodePool, KafkaTopic) from Maven Central.
#
# Strimzi publishes its CRD YAMLs only in release tarballs on GitHub, which these machines cannot reach.
# But the CRDs are generated: Strimzi's build runs its own generator (io.strimzi:crd-generator,
# main class io.strimzi.crdgenerator.CrdGenerator) over the API model classes (io.strimzi:api), both
# published on Maven Central. This script runs that generator with the arguments of Strimzi's own
# build (api/pom.xml, execution "generate-crd-co-install-v1"), so the result is the CRD a release ships.
#
# Output: ${OPENFORGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openforge}/strimzi/<version>/crds/
#   040-Crd-kafka.yaml  043-Crd-kafkatopic.yaml  045-Crd-kafkanodepool.yaml
# A rerun with the output present exits at once.
#
# Needs: mvn (once, to fetch) and Java 21+ (the generator's class files target 21); Java 21+ is found in
# $JAVA_HOME, on PATH, or under /usr/lib/jvm.
#
# Environment:
#   OPENFORGE_CACHE            cache root
#   OPENFORGE_STRIMZI_VERSION  Strimzi release (default below)
#   OPENFORGE_STRIMZI_FORCE=1  regenerate
#
# Prints the CRD folder as the last line of stdout.
set -Eeuo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/install_common.sh" strimzi-crds

VERSION="${OPENFORGE_STRIMZI_VERSION:-1.2.0}"
DEPENDENCY_PLUGIN="org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
FORCE="${OPENFORGE_STRIMZI_FORCE:-0}"
ROOT="$CACHE/strimzi/$VERSION"
CRDS="$ROOT/crds"
MARKER="$CRDS/.complete"

generated() { [ -f "$MARKER" ]; }

exit_if_installed "$FORCE" generated "$CRDS" "already generated"
lock_then_exit_if_installed "$ROOT/.lock" "$FORCE" generated "$CRDS"

java_major() { "$1" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1; }
pick_java() {
    local cand
    for cand in ${JAVA_HOME:+"$JAVA_HOME/bin/java"} "$(command -v java || true)" /usr/lib/jvm/*/bin/java; do
        if [ -n "$cand" ] && [ -x "$cand" ] && [ "$(java_major "$cand")" -ge 21 ] 2>/dev/null; then
            echo "$cand"
            return 0
        fi
    done
    return 1
}
JAVA="$(pick_java)" || die "Java 21+ is needed to run Strimzi's CRD generator (set JAVA_HOME)"
command -v mvn >/dev/null 2>&1 || die "Maven (mvn) is needed once to fetch Strimzi's jars (apt-get install maven)"

WORK="$(mktemp -d "$ROOT/tmp.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>openforge.local</groupId><artifactId>strimzi-crds</artifactId><version>$VERSION</version>
<packaging>pom</packaging><dependencies>
<dependency><groupId>io.strimzi</groupId><artifactId>api</artifactId><version>$VERSION</version></dependency>
<dependency><groupId>io.strimzi</groupId><artifactId>crd-generator</artifactId><version>$VERSION</version></dependency>
</dependencies></project>
POM
log "fetching io.strimzi:api and io.strimzi:crd-generator $VERSION from Maven Central"
# One Maven at a time in the shared local repository (Kafka's jars are fetched into it too, maybe at once).
(cd "$WORK" && flock "$CACHE/m2.lock" nice -n 10 mvn -B -q "-Dmaven.repo.local=$CACHE/m2" \
    "$DEPENDENCY_PLUGIN:copy-dependencies" "-DoutputDirectory=$WORK/libs" -DincludeScope=runtime) >&2

log "generating CRDs with $JAVA ($(java_major "$JAVA"))"
mkdir -p "$WORK/crds"
MODEL="io.strimzi.api.kafka.model"
nice -n 10 "$JAVA" -cp "$WORK/libs/*" io.strimzi.crdgenerator.CrdGenerator \
    --label app:strimzi --label strimzi.io/crd-install:true --target-kube 1.16+ \
    --crd-api-version v1 --api-versions v1 --storage-version v1 --yaml \
    "$MODEL.kafka.Kafka=$WORK/crds/040-Crd-kafka.yaml" \
    "$MODEL.topic.KafkaTopic=$WORK/crds/043-Crd-kafkatopic.yaml" \
    "$MODEL.nodepool.KafkaNodePool=$WORK/crds/045-Crd-kafkanodepool.yaml" >&2
for f in 040-Crd-kafka.yaml 043-Crd-kafkatopic.yaml 045-Crd-kafkanodepool.yaml; do
    grep -q '^kind: CustomResourceDefinition' "$WORK/crds/$f" || die "generator wrote no CRD to $f"
done
echo "strimzi $VERSION generated $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$WORK/crds/.complete"
rm -rf "$CRDS"
mv "$WORK/crds" "$CRDS"
log "done: $CRDS ($((SECONDS - START_S)) s)"
echo "$CRDS"
