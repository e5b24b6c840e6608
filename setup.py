"""Build eformer-nb from settings.ini, the one place its metadata and dependencies live."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
config = ConfigParser(delimiters=["="])
config.read(here / "settings.ini", encoding="utf-8")
cfg = config["DEFAULT"]

for key in ("version", "description", "repo", "lib_name", "lib_path", "author", "author_email", "license", "min_python"):
    if not cfg.get(key):
        raise ValueError(f"settings.ini is missing `{key}`; every key in its [DEFAULT] section is required by setup.py")

lib = cfg["lib_path"]
licenses = {"apache2": "Apache-2.0"}  # settings.ini name -> SPDX expression
if cfg["license"] not in licenses:
    raise ValueError(f"settings.ini license={cfg['license']!r} is not one of {sorted(licenses)}")
spdx = licenses[cfg["license"]]

requirements = cfg.get("requirements", "").split()
dev_requirements = cfg.get("dev_requirements", "").split()
bench_requirements = cfg.get("bench_requirements", "").split()
hf_requirements = cfg.get("hf_requirements", "").split()
llamacpp_requirements = cfg.get("llamacpp_requirements", "").split()
serve_requirements = cfg.get("serve_requirements", "").split()

readme = here / "README.md"
setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else cfg["description"],
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    license=spdx,
    license_files=["LICENSE"],
    keywords=cfg.get("keywords", "").split(),
    url=cfg.get("git_url"),
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Programming Language :: Python :: 3",
        f"Programming Language :: Python :: {cfg['min_python']}",
    ],
    python_requires=f">={cfg['min_python']}",
    packages=setuptools.find_packages(include=[lib, lib + ".*"]),
    include_package_data=True,
    package_data={lib: ["data/*.txt", "data/*.yaml", "data/*.json"]},  # the demo's corpus, example configs, GPU tiles
    install_requires=requirements,
    extras_require={"dev": dev_requirements, "bench": bench_requirements, "hf": hf_requirements,
                    "llamacpp": llamacpp_requirements, "serve": serve_requirements},
    entry_points={"nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    project_urls={"Documentation": cfg["doc_host"] + cfg["doc_baseurl"], "Source": cfg.get("git_url", "")},
    zip_safe=False,
)
