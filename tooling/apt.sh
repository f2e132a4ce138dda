# Sourced: apt_install_missing "package=file-that-proves-it-is-installed ..." installs,
# from Debian's packages, those whose file is missing. Needs say and as_root.
apt_install_missing() {
    local pair missing=()
    for pair in "$@"; do
        [ -e "${pair#*=}" ] || missing+=("${pair%%=*}")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
}
