#!/usr/bin/env bash
# Print an include directory whose Vulkan headers are new enough for the llama.cpp
# vendored in llama-cpp-python (it uses vk::LayerSettingsCreateInfoEXT, header 1.3.261+).
#
# Debian bookworm ships 1.3.239. When the system headers are older than that we fetch
# Debian trixie's libvulkan-dev .deb with apt (a private sources list and state dir, so
# the system's apt setup is untouched), unpack it with `dpkg -x` into a cache, and print
# its include directory. Nothing is installed system-wide.
set -euo pipefail

need=261
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/vulkan-headers"
sys_header=/usr/include/vulkan/vulkan_core.h

header_version() { sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' "$1" 2>/dev/null | head -1; }

if [ -f "$sys_header" ] && [ "$(header_version "$sys_header")" -ge "$need" ]; then
  echo /usr/include; exit 0
fi
if [ -f "$cache/usr/include/vulkan/vulkan_core.h" ]; then
  echo "$cache/usr/include"; exit 0
fi

work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
mirror="$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/\?$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
mirror="${mirror:-http://deb.debian.org/debian}"
mkdir -p "$work/lists/partial" "$work/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$work/trixie.list"
opts=(-o "Dir::Etc::SourceList=$work/trixie.list" -o "Dir::Etc::SourceParts=-" -o "Dir::State::Lists=$work/lists"
      -o "Dir::Cache::Archives=$work/archives" -o "APT::Get::List-Cleanup=0")
echo "fetching Vulkan headers from Debian trixie (system headers are older than 1.3.$need)" >&2
apt-get "${opts[@]}" update >&2
(cd "$work" && apt-get "${opts[@]}" download libvulkan-dev >&2)
rm -rf "$cache.tmp"; mkdir -p "$cache.tmp"
dpkg -x "$work"/libvulkan-dev_*.deb "$cache.tmp"
rm -rf "$cache"; mv "$cache.tmp" "$cache"
echo "Vulkan headers $(header_version "$cache/usr/include/vulkan/vulkan_core.h") in $cache/usr/include" >&2
echo "$cache/usr/include"
